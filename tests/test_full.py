"""Full-weight training (`--finetune full`): every weight moves, the KL reference is the frozen base, checkpoints
hold the whole model and resume exactly, 2 ranks equal 1, and an export is a plain Hugging Face model."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import cli, plain_greedy, read_jsonl, run_cli, tiny_args


def full_args(model, out, steps=2, **extra):
    # lr 1e-3 with the tiny model's fp32 weights: every step moves each weight by ~lr (Adam), far above the
    # 1e-5/1e-6 tolerances below, so a lost or doubled gradient or a skipped step shows
    return tiny_args(model, out, "grpo", steps=steps, **{"finetune": "full", "lr": "1e-3", "eval_n": 3, **extra})


def weights(ckpt):
    return load_file(ckpt / "model.safetensors")


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_reference_is_the_frozen_base_while_the_policy_trains(tiny_model_dir):
    """After real optimizer steps the policy's logits change; inside reference_policy they are the base's bit for
    bit, and after it the policy's again (the swap restores the very tensors the optimizer updates)."""
    from transformers import AutoModelForCausalLM

    from llmrl.models.full import is_full, prepare_full, reference_policy

    model = prepare_full(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), False, True, None)
    assert is_full(model) and all(p.requires_grad for p in model.parameters())
    ids = torch.tensor([[5, 17, 301, 42, 7, 99, 3]])  # 7 tokens: not a power of two
    with torch.no_grad():
        base = model(ids).logits.clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        opt.zero_grad()
        torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().neg().backward()
        opt.step()
    with torch.no_grad():
        trained = model(ids).logits.clone()
        with reference_policy(model):
            ref = model(ids).logits.clone()
        again = model(ids).logits.clone()
    assert (trained - base).abs().max() > 1e-3  # it learned
    assert torch.equal(ref, base)
    assert torch.equal(again, trained)
    for p, copy in zip(model.llmrl_reference.params, model.llmrl_reference.copies):
        assert p.data_ptr() != copy.data_ptr()  # the optimizer's in-place updates never reach the reference


def test_full_weight_checkpoint_moves_every_tensor_and_refuses_the_other_kind(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = cli(*full_args(tiny_model_dir, out, steps=1))
    assert "finetune full: fp32 weights, gradients and AdamW state" in p.stderr
    assert "AutoModelForCausalLM.from_pretrained" in p.stderr
    ckpt = out / "checkpoints/step_000001"
    assert not (ckpt / "adapter_model.safetensors").exists() and (ckpt / "config.json").is_file()
    base, trained = load_file(f"{tiny_model_dir}/model.safetensors"), weights(ckpt)
    assert base.keys() == trained.keys()  # the tied LM head is saved once, as in the base
    assert all((trained[k] - base[k]).abs().max() > 0 for k in base), "a weight did not train"
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(base)  # AdamW state for every tensor
    # the other kind: a LoRA config given this checkpoint is one line naming the mismatch
    bad = run_cli("eval", "--adapter", str(ckpt), "--model", tiny_model_dir, "--task", "toy_task:CharTask",
                  "--finetune", "lora", "--eval_n", "1", "--trust_task_code")
    assert bad.returncode != 0 and "holds full weights, but the config has finetune lora" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_full_weights_with_a_vllm_server_are_one_line_naming_the_way_out(tmp_path, tiny_model_dir):
    p = run_cli(*full_args(tiny_model_dir, tmp_path / "r", rollout_engine="vllm-server"))
    assert p.returncode != 0 and "full weights do not reach a vLLM server" in p.stderr
    assert "use --rollout_engine vllm (in process, the weights reloaded each step) or hf" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()
    p = run_cli(*full_args(tiny_model_dir, tmp_path / "r", finetune="partial"))
    assert p.returncode != 0 and "finetune='partial': must be lora or full" in p.stderr


@pytest.mark.slow
def test_full_weight_resume_is_exact(tmp_path, tiny_model_dir):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cli(*full_args(tiny_model_dir, straight, steps=3))
    cli(*full_args(tiny_model_dir, resumed, steps=2))
    cli("train", "--resume", str(resumed), "--steps", "3", "--trust_task_code")
    assert max_diff(weights(straight / "checkpoints/step_000003"), weights(resumed / "checkpoints/step_000003")) <= 1e-6
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r.get("reward/mean") for r in a] == [r.get("reward/mean") for r in b]


@pytest.mark.slow
def test_full_weights_two_ranks_equal_one(tmp_path, tiny_model_dir):
    """DDP of full weights: the ranks' gradients are summed in one flat all-reduce, so 2 ranks differ from 1 only in
    the order fp32 sums are taken (a few ulps of each gradient, ~1e-7 relative); Adam's step is ~lr = 1e-3 per
    weight, so after 3 steps the weights agree to well under 1e-5 unless a gradient is lost or doubled."""
    one, two = tmp_path / "one", tmp_path / "two"
    cli(*full_args(tiny_model_dir, one, steps=3, lora_dropout=0))
    p = cli(*full_args(tiny_model_dir, two, steps=3, lora_dropout=0), "--nproc", "2")
    assert "launching 2 processes" in p.stderr
    assert max_diff(weights(one / "checkpoints/step_000003"), weights(two / "checkpoints/step_000003")) <= 1e-5
    assert [r["step"] for r in read_jsonl(two / "metrics.jsonl")] == [r["step"] for r in read_jsonl(one / "metrics.jsonl")]


@pytest.mark.slow
def test_export_of_full_weights_is_a_plain_model_with_evals_completions(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cli(*full_args(tiny_model_dir, out, steps=2, eval_n=4, dtype="float32"))
    cli("eval", "--run", str(out), "--output", str(tmp_path / "eval.jsonl"), "--trust_task_code")
    expected = [r["completion"] for r in read_jsonl(tmp_path / "eval.jsonl")]
    p = cli("export", str(out), "--out", str(tmp_path / "model"), "--trust_task_code")  # no --merge needed
    assert "greedy check: 4/4 eval prompts give the trained policy's completion" in p.stderr
    assert "model written to" in p.stdout
    assert "finetune | full" in (tmp_path / "model" / "README.md").read_text()
    assert plain_greedy(tmp_path / "model") == expected and any(expected)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "llama"


def test_memory_plan_counts_by_hand():
    """plan_memory and activation_bytes against hand-worked bytes for a made-up shape (sizes not powers of two)."""
    from llmrl.memory_plan import Shape, activation_bytes, plan_memory

    # 3 blocks of 250_001 parameters, so 250_000 outside them (the root's own: embeddings, final norm)
    s = Shape(params=1_000_003, lora_params=7_001, block_params=250_001, layers=3, hidden=96, kv_dim=32,
              intermediate=260, vocab=1_001)
    common = dict(kl=True, tokens=50, logit_tokens=20, checkpointing=False, act_bytes=4, runtime=11)
    full = plan_memory(s, full=True, world=1, fsdp=False, base_bytes=2, **common)
    assert (full.parameters, full.gradients, full.optimizer, full.reference) == (4_000_012, 4_000_012, 8_000_024, 4_000_012)
    # per token and block: 7·96 + 3·32 + 4·260 = 1808 elements; 3 blocks × 50 tokens × 4 bytes, + 3 × 20 × 1001 × 4
    assert full.activations == 3 * 1808 * 50 * 4 + 3 * 20 * 1001 * 4 == activation_bytes(s, 50, 20, False, 4)
    assert full.peak == 20_000_060 + full.activations + 11
    sharded = plan_memory(s, full=True, world=3, fsdp=True, base_bytes=2, **common)
    assert (sharded.parameters, sharded.optimizer, sharded.reference) == (4_000_012 // 3, 8_000_024 // 3, 4_000_012 // 3)
    # generation holds whole copies of the policy and the reference beside the rank's shards
    assert sharded.gathered == 8_000_024
    # the update: the root's 250_000 and two blocks' 2 × 250_001 parameters unsharded, fp32, with fp32 gradients
    assert sharded.update_gather == 750_002 * 8 == 6_000_016
    # state 3 × 1_333_337 + 2_666_674 = 6_666_685; update 6_666_685 + 1_325_040 + 6_000_016 = 13_991_741 beats
    # generation (no gradients: 6_666_685 - 1_333_337 + 8_000_024 = 13_333_372)
    assert sharded.activations == 1_325_040
    assert sharded.checkpoint == 0 and sharded.peak == 13_991_741 + 11  # full weights: each rank writes its own shards
    lora_sharded = plan_memory(s, full=False, world=2, fsdp=True, base_bytes=2, **common)
    assert lora_sharded.checkpoint == 7_001 * 12  # the adapter and its AdamW moments, gathered to rank 0
    assert lora_sharded.update_gather == 750_002 * 2  # bf16 frozen base: the parameters only, no gradients
    lora = plan_memory(s, full=False, world=2, fsdp=False, base_bytes=2, **common)
    assert (lora.parameters, lora.gradients, lora.optimizer, lora.reference) == (2_000_006 + 28_004, 28_004, 56_008, 0)
    # checkpointing keeps each block's input (96 per token) and one block's tensors
    assert activation_bytes(s, 50, 20, True, 2) == (3 * 96 + 1808) * 50 * 2 + 3 * 20 * 1001 * 4

    # LoRA's CPU speed paths: 900_001 frozen linear weights packed (W and W.T), 600_007 of them adapted and merged
    # while sampling; 6 adapted linears per block reading 5 × 96 + 260 = 740 inputs per token, r 4, dropout on
    import dataclasses

    s2 = dataclasses.replace(s, linear_params=900_001, target_params=600_007, target_inputs=740, targets_per_block=6)
    packed = plan_memory(s2, full=False, world=1, fsdp=False, base_bytes=4, packs="fp32", merge=True, lora=(4, True),
                         **common)
    assert packed.packs == 900_001 * 8 and packed.merged == 600_007 * (4 + 4)  # the merged copy and its pack
    # per token and block: 1808 × 4 bytes, + the A products 4 × 6 × 4, + dropped-out inputs and masks 740 × (4 + 1)
    assert packed.activations == 3 * (7_232 + 96 + 3_700) * 50 + 240_240 == 1_894_440
    # state 4_028_016 + 28_004 + 56_008 + 7_200_008 = 11_312_036; generation (merged, no gradients)
    # 11_312_036 - 28_004 + 4_800_056 = 16_084_088 beats the update's 11_312_036 + 1_894_440
    assert packed.peak == 16_084_088 + 11
    bf16 = plan_memory(s2, full=False, world=1, fsdp=False, base_bytes=4, packs="bf16", merge=False, lora=(4, False),
                       **common)
    assert (bf16.packs, bf16.merged) == (900_001 * 4, 0)
    assert bf16.activations == 3 * (7_232 + 96) * 50 + 240_240  # no dropout: the input itself, counted already
    assert plan_memory(s2, full=True, world=1, fsdp=False, base_bytes=4, lora=(4, True), **common).activations == \
        full.activations  # full weights: no adapter


def test_dry_run_counts_the_models_parameters(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    p = cli(*full_args(tiny_model_dir, tmp_path / "r", kl_coef=0), "--dry_run", "--nproc", "2", "--shard", "fsdp")
    assert not (tmp_path / "r").exists()  # nothing ran
    n = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert f"{n / 1e6:.1f}M parameters, finetune full, 2 rank(s), shard fsdp" in p.stdout
    line = next(x for x in p.stdout.splitlines() if x.strip().startswith("parameters"))
    assert float(line.split()[1]) == pytest.approx(n * 4 / 2 / 2**30, abs=6e-4)  # printed to 1e-3 GiB
    assert "reference copy                  0.000 GiB" in p.stdout  # kl_coef 0: no reference


def test_model_shape_counts_the_linears_a_run_packs_and_merges(tiny_model_dir):
    """model_shape (a meta-device model) against the loaded tiny model: its linear weights (the tied LM head once),
    the LoRA targets' weights, and one block's target inputs and parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmrl.memory_plan import model_shape

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    targets = ["q_proj", "v_proj", "down_proj"]
    s = model_shape(AutoConfig.from_pretrained(tiny_model_dir), targets, 3)
    linears = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert s.linear_params == sum(linears.values())
    adapted = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    assert s.target_params == sum(m.weight.numel() for m in adapted)
    assert s.lora_params == sum(3 * (m.in_features + m.out_features) for m in adapted)
    block = model.model.layers[0]
    assert (s.targets_per_block, s.block_params) == (3, sum(p.numel() for p in block.parameters()))
    assert s.target_inputs == 2 * block.self_attn.q_proj.in_features + block.mlp.down_proj.in_features
