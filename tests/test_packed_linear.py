"""oneDNN packed linears against F.linear: outputs and input gradients, a LoRA policy's log-probs and
LoRA gradients, swapped-in weights (merged LoRA) that must never meet a stale pack."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from llmrl.models import packed_linear
from llmrl.models.loading import add_lora
from llmrl.models.packed_linear import install_packed_linears, onednn_available, release_temporary_packs, uninstall_packed_linears
from llmrl.models.lora import merged_lora
from llmrl.models.scoring import sequence_logprobs

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packed linear")


def frozen_linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    layer.requires_grad_(False)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_and_its_input_gradient(bias):
    torch.manual_seed(0)
    layer = frozen_linear(48, 80, bias)
    x = torch.randn(3, 7, 48, requires_grad=True)
    g = torch.randn(3, 7, 80)
    want = nn.functional.linear(x, layer.weight, layer.bias)
    (want_grad,) = torch.autograd.grad(want, x, g)
    assert install_packed_linears(layer) == 1
    got = layer(x)
    (got_grad,) = torch.autograd.grad(got, x, g)
    assert got.shape == (3, 7, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None  # frozen: no weight gradient
    assert layer(torch.zeros(0, 48)).shape == (0, 80)  # an empty batch falls back to F.linear
    uninstall_packed_linears(layer)
    assert "forward" not in layer.__dict__ and not hasattr(layer, "_llmrl_packs")


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_copies_multiply_in_bf16_with_fp32_in_and_out(bias, onednn, monkeypatch):
    """bf16=True: the products of a frozen fp32 layer and of its input gradient run on bf16 roundings
    of the input, the weight and the incoming gradient, accumulated in fp32, rounded to bf16 on the
    way out and returned as fp32; the bias is added in fp32. Through oneDNN packs, and through plain
    bf16 copies where oneDNN takes no bf16."""
    if not onednn:
        monkeypatch.setattr(packed_linear, "onednn_bf16_available", lambda: False)
    elif not packed_linear.onednn_bf16_available():
        pytest.skip("oneDNN here takes no bf16")
    torch.manual_seed(0)
    layer = frozen_linear(48, 80, bias)
    x = torch.randn(3, 7, 48, requires_grad=True)
    g = torch.randn(3, 7, 80) * 1.37
    fp32 = nn.functional.linear(x, layer.weight, layer.bias)
    (fp32_grad,) = torch.autograd.grad(fp32, x, g)
    w16 = layer.weight.to(torch.bfloat16)
    want = nn.functional.linear(x.detach().to(torch.bfloat16), w16).float() + (0 if layer.bias is None else layer.bias)
    want_grad = (g.reshape(-1, 80).to(torch.bfloat16) @ w16).float().view(3, 7, 48)
    assert install_packed_linears(layer, bf16=True) == 1
    assert layer._llmrl_packs.base.onednn == onednn
    got = layer(x)
    (got_grad,) = torch.autograd.grad(got, x, g)
    with torch.no_grad():  # the path without autograd (sampling, scoring) gives the same
        assert torch.equal(layer(x), got.detach())
    assert got.dtype == got_grad.dtype == torch.float32 and layer.weight.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    torch.testing.assert_close(got, fp32, rtol=2e-2, atol=2e-2)  # bf16: 8 mantissa bits
    assert not torch.equal(got, fp32)
    torch.testing.assert_close(got_grad, fp32_grad, rtol=2e-2, atol=2e-2)


def test_trainable_and_non_fp32_linears_are_left_alone():
    trainable = nn.Linear(4, 4)
    half = frozen_linear(4, 4, False).to(torch.bfloat16)
    assert install_packed_linears(nn.Sequential(trainable, half)) == 0
    assert "forward" not in trainable.__dict__ and "forward" not in half.__dict__


@pytest.mark.parametrize("bf16", [False, True])
def test_swapped_weights_get_their_own_pack_never_a_stale_one(bf16):
    """A weight tensor swapped in (as merged LoRA does) is packed for itself; after release, a new
    tensor at a possibly reused address is packed again, and the original weight uses its own pack."""
    torch.manual_seed(0)
    layer = frozen_linear(32, 24, False)
    install_packed_linears(layer, bf16=bf16)
    base = layer.weight.data
    x = torch.randn(5, 32)
    tol = 3e-2 if bf16 else 1e-5
    for k in range(4):
        other = base + (k + 1.0)  # a fresh tensor each time; its memory may reuse the last one's
        layer.weight.data = other
        torch.testing.assert_close(layer(x), x @ other.T, rtol=tol, atol=tol * 10)
        layer.weight.data = base
        release_temporary_packs(layer)
        assert layer._llmrl_packs.temporary is None
        del other
        torch.testing.assert_close(layer(x), x @ base.T, rtol=tol, atol=tol)


def lora_policy(model_dir: str):
    """The tiny model with LoRA on q, v, up, its B matrices non-zero (so merging changes weights)."""
    torch.manual_seed(1)
    model = add_lora(AutoModelForCausalLM.from_pretrained(model_dir), 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def test_policy_logprobs_and_lora_gradients_match_with_packed_linears(tiny_model_dir):
    torch.manual_seed(3)
    ids = torch.randint(3, 1000, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    results = []
    for packed in (False, True):
        model = lora_policy(tiny_model_dir)
        if packed:
            assert install_packed_linears(model) > 0  # base q/v/up, the other linears and the LM head
            assert "forward" not in model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].__dict__
        logp, _ = sequence_logprobs(model, ids, mask, 6)
        logp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad(), merged_lora(model):
            merged = sequence_logprobs(model, ids, mask, 6)[0]
        if packed:
            assert all(m._llmrl_packs.temporary is None for m in model.modules() if hasattr(m, "_llmrl_packs"))
        results.append((logp.detach(), grads, merged))
    (logp_a, grads_a, merged_a), (logp_b, grads_b, merged_b) = results
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_b, merged_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_b, logp_b, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 12
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_without_onednn_nothing_changes(monkeypatch):
    monkeypatch.setattr(packed_linear, "onednn_available", lambda: False)
    layer = frozen_linear(4, 4, False)
    assert install_packed_linears(layer) == 0 and "forward" not in layer.__dict__


def test_packs_that_would_not_fit_the_memory_budget_are_not_made():
    layer = frozen_linear(64, 32, False)  # 8 KiB of weights: 16 KiB of packs
    assert install_packed_linears(layer, memory_budget=16 * 1024 - 1) == 0 and "forward" not in layer.__dict__
    assert install_packed_linears(layer, memory_budget=16 * 1024) == 1


def test_peft_merge_and_unload_in_place_repacks_the_base_weights(tiny_model_dir):
    """merge_and_unload adds ΔW into the base weights in place (same storage): the packed layers must
    compute with the merged weights afterwards, not with a stale pack of the old ones."""
    model = lora_policy(tiny_model_dir)
    install_packed_linears(model)
    ids = torch.randint(3, 1000, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = sequence_logprobs(model, ids, mask, 4)[0]  # LoRA unmerged
        q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        ptr = q.weight.data_ptr()
        merged = model.merge_and_unload()
        assert merged.model.layers[0].self_attn.q_proj is q and q.weight.data_ptr() == ptr  # edited in place
        got = sequence_logprobs(merged, ids, mask, 4)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("faster", [True, False])
def test_packing_is_used_only_where_the_start_up_measurement_finds_it_faster(tiny_model_dir, monkeypatch, tmp_path,
                                                                            faster):
    from llmrl.config import load_config, resolve
    from llmrl.training.run import build_policy

    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path))  # no verdict cached yet
    monkeypatch.setattr("llmrl.threads.measure_others", lambda: (0.0, 2))  # a quiet machine: the verdict is kept
    seen = []

    def measured(out_features, in_features, **kw):
        seen.append((out_features, in_features))
        return faster, {"F.linear": 100.0, "onednn_packed": 150.0 if faster else 90.0}

    monkeypatch.setattr(packed_linear, "packing_pays", measured)
    cfg = load_config(None, {"model": tiny_model_dir, "device": "cpu", "lora_r": 4})
    assert cfg.onednn_linear is None  # the default: decide by measurement
    model, _, choice = build_policy(cfg, resolve(cfg))
    packed = [m for m in model.modules() if hasattr(m, "_llmrl_packs")]
    # measured once, on the shape that holds most frozen weight: in the tiny Llama its LM head (vocab x 32)
    assert seen == [(model.get_base_model().lm_head.weight.shape[0], 32)]
    assert bool(packed) is (faster and onednn_available())
    assert choice.startswith("frozen linears: " + ("oneDNN packed" if faster else "F.linear")) and "GFLOP/s" in choice
    forced = load_config(None, {"model": tiny_model_dir, "device": "cpu", "lora_r": 4, "onednn_linear": False})
    assert build_policy(forced, resolve(forced))[2] == "frozen linears: F.linear" and len(seen) == 1
    # the verdict is kept per machine: the next run makes the same choice without measuring again
    assert (tmp_path / "kernels.json").exists()
    again, _, choice_again = build_policy(cfg, resolve(cfg))
    assert len(seen) == 1 and choice_again == choice
    assert bool([m for m in again.modules() if hasattr(m, "_llmrl_packs")]) is bool(packed)


def test_the_kernel_choice_is_recorded_in_the_run_config(tmp_path, tiny_model_dir):
    from helpers import cli, tiny_args

    out = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, out, "grpo", steps=1, eval_interval=0))
    text = (out / "config.yaml").read_text()
    assert "# resolved here: frozen linears: " in text
    from llmrl.config import load_config

    assert load_config(out / "config.yaml").steps == 1  # the note is a comment: the config still loads
