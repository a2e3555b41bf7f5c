"""Seed mode is the course starter's: zero advantages for groups with equal rewards, warmup counted in
RL steps, and rewards/eval/row filtering equal to the starter's on the inputs in tests/fixtures."""

import json
from pathlib import Path

import pytest
from helpers import cli, lora_tensors, read_jsonl, tiny_args, train_records

TESTS = Path(__file__).parent
FIXTURES = TESTS / "fixtures"
PROMPTS = TESTS.parent / "examples" / "brevity_prompts.jsonl"


def test_constant_reward_run_has_zero_advantages_and_leaves_lora_b_at_zero(tmp_path, tiny_model_dir):
    """Reward 0.3 everywhere, G = 6 (the seed's format_copy group), no KL: there is nothing to learn."""
    out = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=f"{TESTS / 'constant_reward.py'}:reward",
                   prompts=str(PROMPTS), group_size=6, minibatch_size=4, grad_accum_steps=2, kl_coef=0,
                   lora_dropout=0, eval_interval=0, eval_n=0, warmup_steps=0))
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 2 * 6
    assert all(r["reward"] == 0.3 and r["advantage"] == 0.0 for r in samples)
    records = train_records(out)
    assert all(r["adv/min"] == 0.0 == r["adv/max"] and r["rollout/zero_spread_frac"] == 1.0 for r in records)
    assert records[-1]["train/optimizer_steps"] == 2 * 3  # updates ran: 2 epochs × 3 minibatches, windows of 2
    weights = lora_tensors(out / "checkpoints" / "step_000002")
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert lora_b and all((v == 0).all() for v in lora_b.values())


def test_warmup_is_counted_in_rl_steps(tmp_path, tiny_model_dir):
    """warmup 4 with 2 optimizer steps per RL step: RL step s (0-based) uses lr·(s+1)/4 (the starter)."""
    out = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, out, "grpo", steps=3, lr=0.03, warmup_steps=4, minibatch_size=3,
                   grad_accum_steps=1, ppo_epochs=1, eval_interval=0, eval_n=0, save_interval=0))
    records = train_records(out)
    assert [r["train/optimizer_steps"] for r in records] == [2, 4, 6]
    assert [r["train/lr"] for r in records] == pytest.approx([0.0075, 0.015, 0.0225], rel=1e-12)


def test_math500_style_rows_are_the_starters():
    """Integer levels (MATH-500's format) are read; the kept rows, their order and golds are exactly
    those of the starter's _build_rows on the same file (fixtures/math500_style_expected.json)."""
    from llmrl.tasks.math_hard import MathHardTask

    expected = json.loads((FIXTURES / "math500_style_expected.json").read_text())["kept"]
    task = MathHardTask(data=str(FIXTURES / "math500_style.jsonl"))
    for rows in (task.train_rows, task.test_rows):  # a file without `split` serves both
        assert [(r["unique_id"], r["problem"]) for r in rows] == [(e["unique_id"], e["problem"]) for e in expected]
        assert [r["gold"] for r in rows] == [e["gold"] for e in expected]  # exact floats
    assert task.data_report["test"]["kept"] == len(expected) == 36
    assert sum(task.data_report["test"]["dropped"].values()) == 72 - 36


def test_math_train_sampling_is_the_starters_randrange():
    from llmrl.tasks.math_hard import MathHardTask

    task = MathHardTask(seed=3, data=str(FIXTURES / "math500_style.jsonl"))
    import random

    rng = random.Random(3)
    picks = [task.train_rows[rng.randrange(len(task.train_rows))]["gold"] for _ in range(20)]
    assert [ex.answer for ex in task.sample_train_batch(20)] == picks


def _fixture(name: str) -> list[dict]:
    return read_jsonl(FIXTURES / f"seed_parity_{name}.jsonl")


def test_format_copy_rewards_equal_the_starters():
    """Every case: reward and its three parts exactly as the starter computed them (fixture built by
    running the starter's FormatCopyTask.reward outside this project)."""
    from llmrl.tasks.format_copy import FormatCopyTask, grade

    cases = _fixture("format_copy")
    assert len(cases) >= 300 and sum(c["source"] == "embedded_run" for c in cases) >= 200
    task = FormatCopyTask()
    for c in cases:
        g = grade(c["completion"], c["target"])
        assert (g.has_tag, g.strict, g.exact) == (c["has_tag"], c["strict"], c["exact"]), c
        assert task.reward(task.example(c["target"]), c["completion"]).total == c["reward"], c


def test_math_hard_seed_rewards_and_eval_equal_the_starters():
    from llmrl.tasks.math_hard import MathHardTask, grade

    cases = _fixture("math_hard")
    assert len(cases) >= 300
    task = MathHardTask(data=str(FIXTURES / "math_tiny.jsonl"))
    for c in cases:
        ex = task.example({"problem": "p", "gold": c["gold"], "gold_text": str(c["gold"])})
        r = task.reward(ex, c["completion"])
        assert r.total == c["reward"], c
        assert (r.components["boxed"], r.components["boxed_exact"], r.components["relaxed"]) == (
            c["format"], c["exact"], c["relaxed_bonus"]), c
        g = grade(c["completion"], c["gold"])
        assert (g.boxed_exact, g.boxed_exact or g.last_exact, g.boxed) == (
            c["eval_boxed_exact"], c["eval_relaxed_exact"], c["eval_boxed"]), c
