"""End to end through the real CLI on a random tiny model: files, weights, resume, plain-PEFT reload."""

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import TRAIN_KEYS, cli, lora_tensors, read_jsonl, tiny_args


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "reinforce"])
def test_train_two_steps_writes_everything_and_moves_lora(tmp_path, tiny_model_dir, algo):
    out = tmp_path / algo
    cli(*tiny_args(tiny_model_dir, out, algo))

    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/distinct" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 1, 2]
    for r in train:
        assert TRAIN_KEYS <= set(r), TRAIN_KEYS - set(r)
        assert all(v is None or math.isfinite(v) for v in r.values())
        assert r["train/kl"] >= 0 and 0 <= r["rollout/truncated_frac"] <= 1
        assert 0 < r["time/generate_s"] and 0 < r["time/logprobs_s"]  # the parts of the rollout's time
        assert r["time/generate_s"] + r["time/logprobs_s"] < r["time/rollout_s"]
    opt_steps = 2 * 2 if algo == "grpo" else 2  # 6 completions / minibatch 3 = 2 optimizer steps per epoch
    assert train[-1]["train/optimizer_steps"] == 2 * opt_steps

    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 6 and {"step", "prompt", "completion", "reward", "components", "advantage"} <= set(samples[0])
    assert len(read_jsonl(out / "eval_samples.jsonl")) == 3 * 2

    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000002"
    for step in (1, 2):
        d = ckpts / f"step_{step:06d}"
        for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "rng.pt", "trainer_state.json"):
            assert (d / name).is_file(), name
        assert json.loads((d / "trainer_state.json").read_text())["step"] == step
    first, second = lora_tensors(ckpts / "step_000001"), lora_tensors(ckpts / "step_000002")
    b_weights = [k for k in second if "lora_B" in k]
    assert b_weights and all(second[k].abs().sum() > 0 for k in b_weights)  # B starts at zero
    assert any(not torch.equal(first[k], second[k]) for k in second)


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, tiny_model_dir):
    full, cut = tmp_path / "full", tmp_path / "cut"
    cli(*tiny_args(tiny_model_dir, full, "grpo", steps=3))
    cli(*tiny_args(tiny_model_dir, cut, "grpo", steps=2))
    cli("train", "--resume", str(cut), "--steps", "3", "--trust_task_code")

    train_steps = [r["step"] for r in read_jsonl(cut / "metrics.jsonl") if "reward/mean" in r]
    assert train_steps == [1, 2, 3]
    a, b = lora_tensors(full / "checkpoints" / "step_000003"), lora_tensors(cut / "checkpoints" / "step_000003")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    full_rewards = [r["reward/mean"] for r in read_jsonl(full / "metrics.jsonl") if "reward/mean" in r]
    cut_rewards = [r["reward/mean"] for r in read_jsonl(cut / "metrics.jsonl") if "reward/mean" in r]
    assert full_rewards == pytest.approx(cut_rewards, abs=1e-6)


def test_saved_adapter_reloads_with_plain_peft_and_gives_the_same_logits(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmrl.config import load_config
    from llmrl.training.loop import train

    args = tiny_args(tiny_model_dir, tmp_path / "run", "grpo")[1:]
    overrides = {args[i].lstrip("-"): args[i + 1] for i in range(0, len(args), 2)}
    result = train(load_config(None, {**overrides, "eval_n": "0"}))
    policy = result.model.eval()

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "run" / "checkpoints" / "step_000002")).eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(policy(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-6)
        with policy.disable_adapter():
            assert not torch.allclose(policy(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-6)


@pytest.mark.slow
def test_eval_command_on_a_run(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, out, "reinforce", steps=1))
    p = cli("eval", "--run", str(out), "--output", str(tmp_path / "graded.jsonl"), "--trust_task_code")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["adapter"].endswith("step_000001") and "eval/distinct" in result
    assert len(read_jsonl(tmp_path / "graded.jsonl")) == 2


def test_format_copy_runs_end_to_end(tmp_path, tiny_model_dir):
    out = tmp_path / "fc"
    args = tiny_args(tiny_model_dir, out, "reinforce", steps=1)
    args[args.index("toy_task:CharTask")] = "format_copy"
    cli(*args)
    rec = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r][0]
    assert {"reward/has_tag", "reward/strict", "reward/exact"} <= set(rec)
    ev = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/exact_match" in r]
    assert {"eval/has_tag", "eval/strict"} <= set(ev[0])


def test_every_variant_trains_end_to_end(tmp_path, tiny_model_dir):
    """One run with every non-default switch: finite metrics, the new reward terms and counters logged."""
    out = tmp_path / "run"
    cli(*tiny_args(str(tiny_model_dir), out, "grpo", steps=2, adv_estimator="rloo", loss_agg="token_mean",
                   ratio_level="sequence", clip_eps_low=0.2, clip_eps_high=0.28, kl_estimator="k2", kl_in_reward="true",
                   overlong_buffer=2, overlong_filter="true", dynamic_sampling="true", dynamic_sampling_rounds=2))
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(train) == 2
    for r in train:
        assert {"reward/overlong", "reward/kl_penalty", "train/clip_frac_low", "train/clip_frac_high",
                "rollout/sampling_rounds", "rollout/groups_flat_kept"} <= set(r)
        assert r["train/kl"] == 0.0  # the KL went into the reward, not the loss
        # equal-reward groups fill the batch only after every round was used
        assert r["rollout/groups_flat_kept"] == 0 or r["rollout/sampling_rounds"] == 2
        assert all(v is None or math.isfinite(v) for v in r.values() if isinstance(v, float))
    assert train[-1]["rollout/completions"] == 2 * 2 * 3  # B·G per step whatever the rounds


EXAMPLES = Path(__file__).parent.parent / "examples"


def test_plain_reward_function_task_from_a_file(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cli(*tiny_args(str(tiny_model_dir), out, "reinforce", steps=1, task=f"{EXAMPLES / 'brevity_reward.py'}:reward",
                   prompts=str(EXAMPLES / "brevity_prompts.jsonl")))
    [train] = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert "reward/reward" in train and "eval/scored" in read_jsonl(out / "metrics.jsonl")[-1]
