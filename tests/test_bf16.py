"""bf16 on CPU: the auto precision choice (bf16 products on fp32 weights), full bf16 (dtype=bfloat16),
log-probs and LoRA gradients against fp32, and old = new log-probs at θ_old."""

import pytest
import torch

from llmrl.models import packed_linear
from llmrl.models.scoring import chunked_logprobs, sequence_logprobs, shared_prefix_logprobs

MESSAGES = [[{"role": "user", "content": "Copy: alpha beta gamma"}],
            [{"role": "user", "content": "Repeat the words seven, eight"}],
            [{"role": "user", "content": "Say <answer>ok</answer> please, and nothing else"}]]


def policy(tiny_model_dir, dtype: str, monkeypatch=None, **overrides):
    """dtype: float32, bfloat16 (weights and activations), or auto-bf16 (auto where bf16 products pay)."""
    from llmrl.config import load_config, resolve
    from llmrl.training.run import build_policy

    if dtype == "auto-bf16":
        monkeypatch.setenv(packed_linear.CPU_DTYPE_ENV, "bfloat16")
        dtype = "auto"
    cfg = load_config(None, {"model": tiny_model_dir, "device": "cpu", "lora_r": 4, "dtype": dtype,
                             "lora_dropout": 0.0, "gradient_checkpointing": False, **overrides})
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    with torch.no_grad():  # a LoRA that changes the outputs (B starts at zero)
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, tok, plan


def sequences(tok, n=7, prompt=11, completion=13):
    """[n, prompt + completion] token ids, the first rows left-padded, and their mask."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, tok.vocab_size, (n, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    for i, pad in enumerate([3, 1, 0, 0, 2, 0, 0][:n]):
        mask[i, :pad] = 0
        ids[i, :pad] = tok.pad_token_id
    return ids, mask, prompt


def test_auto_picks_bf16_only_with_a_native_unit_that_measures_faster(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path))
    monkeypatch.delenv(packed_linear.CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr("llmrl.threads.measure_others", lambda: (0.0, 2))  # a quiet machine: verdicts are kept
    seen = []

    def measured(faster):
        def run(**kw):
            seen.append(1)
            return faster, {"fp32": 300.0, "bf16": 1500.0 if faster else 250.0}
        return run

    monkeypatch.setattr(packed_linear, "cpu_bf16_flags", lambda: [])
    monkeypatch.setattr(packed_linear, "bf16_pays", measured(True))
    bf16, line = packed_linear.cpu_auto_precision()
    assert not bf16 and "no native bf16 unit" in line and not seen  # no unit: not even measured
    monkeypatch.setattr(packed_linear, "cpu_bf16_flags", lambda: ["amx_bf16"])
    bf16, line = packed_linear.cpu_auto_precision()
    assert bf16 and "bf16 1500" in line and seen == [1]
    monkeypatch.setattr(packed_linear, "bf16_pays", measured(False))
    assert packed_linear.cpu_auto_precision()[0] and seen == [1]  # the cached verdict, not a new one
    (tmp_path / "kernels.json").unlink()
    assert not packed_linear.cpu_auto_precision()[0] and seen == [1, 1]  # measured slower: fp32
    for forced in ("bfloat16", "float32"):
        monkeypatch.setenv(packed_linear.CPU_DTYPE_ENV, forced)
        bf16, line = packed_linear.cpu_auto_precision()
        assert bf16 is (forced == "bfloat16") and line.endswith(f"(LLMRL_CPU_DTYPE={forced})")
    monkeypatch.setenv(packed_linear.CPU_DTYPE_ENV, "fp16")
    with pytest.raises(ValueError, match="must be float32 or bfloat16"):
        packed_linear.cpu_auto_precision()


def test_bf16_plans_take_old_logprobs_from_a_forward_not_the_sampler(tiny_model_dir, monkeypatch):
    from llmrl.config import load_config, resolve

    plans = {d: resolve(load_config(None, {"model": tiny_model_dir, "device": "cpu", "dtype": d})) for d in ("float32", "bfloat16")}
    assert plans["float32"].sampler_logp and not plans["bfloat16"].sampler_logp
    assert plans["bfloat16"].precision == "precision: bfloat16 (dtype=bfloat16)" and not plans["bfloat16"].bf16_matmul
    monkeypatch.setenv(packed_linear.CPU_DTYPE_ENV, "bfloat16")
    auto = resolve(load_config(None, {"model": tiny_model_dir, "device": "cpu"}))
    assert auto.bf16_matmul and auto.dtype == torch.float32 and not auto.sampler_logp
    # LoRA is merged for sampling only where the merged weight is multiplied in fp32
    assert plans["float32"].merge_lora and not plans["bfloat16"].merge_lora and not auto.merge_lora
    assert not resolve(load_config(None, {"model": tiny_model_dir, "device": "cpu", "fast": False})).bf16_matmul


# gradient cosine to fp32: 0.98 with bf16 activations (the LoRA branch and residual sums rounded), > 0.99
# with bf16 products only
@pytest.mark.parametrize("dtype, mean_tol, cos_tol", [("auto-bf16", 0.01, 0.99), ("bfloat16", 0.02, 0.97)])
def test_bf16_logprobs_and_lora_gradients_agree_with_fp32(tiny_model_dir, monkeypatch, dtype, mean_tol, cos_tol):
    fp32, tok, _ = policy(tiny_model_dir, "float32")
    bf16, _, _ = policy(tiny_model_dir, dtype, monkeypatch)
    up = bf16.get_base_model().model.layers[0].mlp.up_proj.base_layer
    if dtype == "bfloat16":  # weights and activations in bf16
        assert up.weight.dtype == torch.bfloat16
    else:  # fp32 weights, multiplied through bf16 copies
        assert up.weight.dtype == torch.float32 and up._llmrl_packs.base.forward.dtype == torch.bfloat16
    assert {p.dtype for p in bf16.parameters() if p.requires_grad} == {torch.float32}
    ids, mask, prompt = sequences(tok)
    fp32.train(), bf16.train()  # (dropout 0)
    want = sequence_logprobs(fp32, ids, mask, prompt)[0]
    got = sequence_logprobs(bf16, ids, mask, prompt)[0]
    assert got.dtype == torch.float32
    diff = (got - want)[:, prompt - 1 :].abs()
    # bf16 keeps 8 bits of mantissa: log-probs of ~-10.8 nats (49k-token vocab, near-uniform tiny model) move
    # by ~1e-2 with bf16 activations (measured 0.012, largest 0.11), a few 1e-3 with bf16 products only
    assert 0 < diff.mean() < mean_tol and diff.max() < 0.2, (diff.mean(), diff.max())
    assert got[:, prompt - 1 :].mean() < -5.0
    grads = {}
    for name, model, lp in (("fp32", fp32, want), ("bf16", bf16, got)):
        model.zero_grad()
        (lp * (torch.arange(lp.shape[1]) >= prompt - 1)).sum().backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    assert grads["bf16"].dtype == torch.float32 and torch.isfinite(grads["bf16"]).all()
    cosine = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cosine > cos_tol, cosine


@pytest.mark.parametrize("dtype", ["auto-bf16", "bfloat16"])
def test_bf16_old_and_new_logprobs_are_the_same_at_theta_old(tiny_model_dir, monkeypatch, dtype):
    """In bf16 the rollout's old log-probs come from a no-grad forward laid out like the training
    forward (plan.sampler_logp is off), so at θ_old the PPO ratio of the first minibatch is 1 up to
    fp32 summation order. (The sampler's decode-step logits run 16-row products whose bf16 kernels
    round differently from a training forward's: measured on the embedded model, 2.5e-2 nats per
    token apart; on this tiny model they happen to agree, so only the tokens are compared here.)"""
    from llmrl.rollout.base import Sampling, add_logprobs
    from llmrl.rollout.episodes import one_turn
    from llmrl.rollout.hf import HFEngine
    from llmrl.training.update import trim_to_completions

    model, tok, plan = policy(tiny_model_dir, dtype, monkeypatch)
    assert not plan.sampler_logp
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=0, repetition_penalty=1.0, min_new_tokens=1,
                        max_new_tokens=9, max_prompt_tokens=64)
    rollouts = {}
    for from_sampler in (False, True):
        engine = HFEngine(tok, sampling, merge_lora=True, sampler_logp=from_sampler)
        engine.load(model, 0)
        r = one_turn(engine, tok, MESSAGES, group_size=3, seed=4, sampling=sampling, device="cpu")
        rollouts[from_sampler] = add_logprobs(model, r, chunk=6, group_size=3, shared_prefix=True, with_ref=False)
    r = rollouts[False]
    assert torch.equal(r.input_ids, rollouts[True].input_ids)
    model.train()  # the training forward: rows 1, 4, 5, 8 of the window, shared prefix, trimmed columns
    rows = torch.tensor([1, 4, 5, 8])
    mb = trim_to_completions({"input_ids": r.input_ids[rows], "attention_mask": r.attention_mask[rows],
                              "completion_mask": r.completion_mask[rows], "logp_old": r.logp_old[rows]}, r.prompt_len)
    new = shared_prefix_logprobs(model, mb["input_ids"], mb["attention_mask"], r.prompt_len, rows // 3)[0]
    m = mb["completion_mask"] > 0
    gap = (new - mb["logp_old"])[m].abs().max().item()
    assert gap <= 1e-4, gap
    again = chunked_logprobs(model.eval(), r.input_ids, r.attention_mask, r.prompt_len, 9)[0] * r.completion_mask
    # another layout (no shared prefix, all rows): a bf16 rounding can flip (measured: one token, 4.9e-4)
    assert (again - r.logp_old).abs().max() <= 2e-3


@pytest.mark.parametrize("dtype", ["auto-bf16", "bfloat16"])
def test_lora_is_not_merged_into_weights_multiplied_in_bf16(tiny_model_dir, monkeypatch, dtype):
    """A merged copy W + ΔW rounded to bf16 loses much of a small ΔW (on the embedded model one adapter
    scored greedy exact-match 0.22 merged that way, 0.58 unmerged): `merged_lora` leaves such layers
    unmerged, so sampling sees exactly the policy that is trained. In fp32 it merges (the log-probs
    move by summation order only)."""
    from llmrl.models.lora import merged_lora

    ids, mask, prompt = sequences(policy(tiny_model_dir, "float32")[1])
    for kind in (dtype, "float32"):
        model, _, _ = policy(tiny_model_dir, kind, monkeypatch)
        with torch.no_grad():  # a small adapter, as after a few RL steps: |ΔW| well under W's bf16 spacing
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.01)
        model.eval()
        with torch.no_grad():
            plain = sequence_logprobs(model, ids, mask, prompt)[0]
            with merged_lora(model):
                merged = sequence_logprobs(model, ids, mask, prompt)[0]
                n_merged = sum(1 for m in model.modules() if getattr(m, "merged_adapters", None))
            base = model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight
        if kind == "float32":
            assert n_merged > 0 and not torch.equal(merged, plain)
            torch.testing.assert_close(merged, plain, rtol=1e-5, atol=1e-5)
        else:
            assert n_merged == 0 and torch.equal(merged, plain)
        assert base.dtype == (torch.bfloat16 if kind == "bfloat16" else torch.float32)


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_attention_runs_in_fp32_grouped_only_on_the_fast_path(tiny_model_dir, monkeypatch, fast):
    """dtype=bfloat16 on CPU runs attention in fp32; the fast path reads grouped key/value heads in place,
    `--fast false` keeps transformers' own SDPA (its plain twin), with the same log-probs."""
    from llmrl.models.loading import _attention_implementation

    model, tok, plan = policy(tiny_model_dir, "bfloat16", monkeypatch, fast=fast)
    assert plan.grouped_attention == fast
    assert _attention_implementation(model) == ("llmrl_sdpa_gqa_fp32" if fast else "llmrl_sdpa_fp32")
    ids, mask, prompt = sequences(tok)
    with torch.no_grad():
        logp = sequence_logprobs(model, ids, mask, prompt)[0]
    other, _, _ = policy(tiny_model_dir, "bfloat16", monkeypatch, fast=not fast)
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(other, ids, mask, prompt)[0], logp, rtol=0, atol=2e-2)
