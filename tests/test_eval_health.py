"""Sampled eval (pass@k, maj@k) on hand-worked numbers and end to end, and the run-health warnings."""


import pytest

from helpers import TESTS, cli, read_jsonl, run_cli, tiny_args
from llmrl.tasks.base import Judgement
from llmrl.training.evaluate import majority_correct, pass_at_k, pass_ks, sampled_metrics

PROMPTS = TESTS.parent / "examples" / "brevity_prompts.jsonl"


@pytest.mark.parametrize("n, c, k, expected", [
    (8, 0, 1, 0.0), (8, 0, 8, 0.0),  # nothing correct: never
    (8, 8, 1, 1.0), (8, 8, 4, 1.0),  # everything correct: always
    (8, 3, 8, 1.0),  # k = n with one correct: certain
    (8, 3, 1, 3 / 8),  # pass@1 is the fraction correct
    (8, 3, 2, 1 - (5 * 4) / (8 * 7)),  # 1 − C(5,2)/C(8,2) = 1 − 10/28
    (8, 3, 4, 1 - 5 / 70),  # C(5,4) = 5, C(8,4) = 70
    (5, 1, 3, 3 / 5),  # one correct among 5, 3 drawn: 1 − C(4,3)/C(5,3) = 1 − 4/10
    (7, 2, 6, 1.0),  # n − c = 5 < k
    (7, 2, 5, 1 - 1 / 21),  # C(5,5) = 1, C(7,5) = 21
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_ks_are_powers_of_two_and_n():
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1] and pass_ks(3) == [1, 2, 3]


def test_majority_vote_by_hand():
    J = Judgement
    assert majority_correct([J(False, 5), J(True, 7), J(False, 5)]) is False  # 5 wins 2:1, and 5 is wrong
    assert majority_correct([J(True, 7), J(False, 5), J(True, 7), J(False, None), J(False, None)]) is True  # no-answer does not vote
    assert majority_correct([J(False, 5), J(True, 7)]) is False  # a tie goes to the first seen
    assert majority_correct([J(True, 7), J(False, 5)]) is True
    assert majority_correct([J(False, None)] * 3) is False


def test_sampled_metrics_over_groups():
    J = Judgement
    judged = [J(True, 1), J(False, 2), J(False, 2), J(False, 3),  # prompt 0: c = 1, majority 2 (wrong)
              J(True, 4), J(True, 4), J(True, 4), J(False, 5)]  # prompt 1: c = 3, majority 4 (right)
    m = sampled_metrics(judged, 4)
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert m["eval/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 0 / 6)) / 2)  # C(3,2)/C(4,2) = 3/6; C(1,2) = 0
    assert m["eval/pass@4"] == pytest.approx(1.0)
    assert m["eval/maj@4"] == pytest.approx(0.5)


@pytest.mark.slow
def test_format_copy_sampled_eval_logs_pass_at_k_and_resumes_exactly(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    args = tiny_args(tiny_model_dir, out, "grpo", steps=2, task="format_copy", eval_samples_per_prompt=8,
                     eval_temperature=1.0, eval_n=3, max_new_tokens=6)
    cli(*args)
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/pass@8", "eval/maj@8", "eval/exact_match"} <= set(r)
        assert r["eval/pass@1"] == pytest.approx(r["eval/exact_match"])  # both: the mean over the 24 samples
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= r["eval/pass@4"] <= r["eval/pass@8"] <= 1
    assert len(read_jsonl(out / "eval_samples.jsonl")) == 3 * 3 * 8
    # resume from step 1: the step-2 eval is the same, sample for sample
    resumed = tmp_path / "resumed"
    cli(*tiny_args(tiny_model_dir, resumed, "grpo", steps=1, task="format_copy", eval_samples_per_prompt=8,
                   eval_temperature=1.0, eval_n=3, max_new_tokens=6))
    cli("train", "--resume", str(resumed), "--steps", "2")
    again = [r for r in read_jsonl(resumed / "metrics.jsonl") if "eval/pass@1" in r]
    for key in ("eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/pass@8", "eval/maj@8", "eval/reward"):
        assert [r[key] for r in again] == [r[key] for r in evals], key
    texts = lambda d: [(r["step"], r["completion"]) for r in read_jsonl(d / "eval_samples.jsonl")]  # noqa: E731
    assert texts(resumed) == texts(out)


def test_truncation_warning_within_three_steps(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=4, max_new_tokens=2, min_new_tokens=2, eval_n=0))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "warning" in line and "max_new_tokens=2" in line]
    assert len(lines) == 1 and "step 3" in lines[0] and "raise max_new_tokens" in lines[0], p.stderr[-2000:]
    warned = [r for r in read_jsonl(out / "metrics.jsonl") if "warnings" in r]
    assert [r["step"] for r in warned] == [3] and "max_new_tokens=2" in warned[0]["warnings"][0]


@pytest.mark.slow
def test_constant_reward_warns_no_spread_and_strict_health_stops_cleanly(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=4, task=f"{TESTS / 'constant_reward.py'}:reward",
                           prompts=str(PROMPTS), eval_n=0))
    assert p.returncode == 0
    told = [line for line in p.stderr.splitlines() if line.startswith("llmrl: warning: step") and "max_new_tokens" not in line]
    assert len(told) == 1 and "step 3" in told[0], p.stderr[-2000:]  # one line: a constant reward has no spread
    assert "every completion scored 0.3 for 3 steps in a row: no reward spread, nothing to learn" in told[0]
    strict = tmp_path / "strict"
    p = run_cli(*tiny_args(tiny_model_dir, strict, "grpo", steps=6, task=f"{TESTS / 'constant_reward.py'}:reward",
                           prompts=str(PROMPTS), eval_n=0, strict_health="true", save_interval=100))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "strict_health" in p.stderr and (strict / "checkpoints" / "step_000003").is_dir()
    assert max(r["step"] for r in read_jsonl(strict / "metrics.jsonl")) == 3


def test_a_run_whose_every_reward_call_fails_is_told_for_three_steps_in_a_row_only():
    """reward/errors and rollout/completions are totals: the condition is this step's errors equal to this
    step's completions (12 of 12), health_steps (3) steps in a row; 11 of 12 breaks the streak."""
    from llmrl.config import TrainConfig
    from llmrl.training.health import Health

    cfg, health = TrainConfig(health_steps=3), Health()

    def step(errors, completions):
        return health.check(cfg, {"reward/errors": errors, "rollout/completions": completions,
                                  "reward/min": 0.0, "reward/max": 0.5})

    assert step(12, 12) == [] and step(24, 24) == []
    assert step(35, 36) == []  # 11 of the step's 12 failed: one reward was read
    assert step(47, 48) == [] and step(59, 60) == []  # two in a row
    assert step(70, 72) == []  # 10 of 12: the streak starts again
    assert step(82, 84) == [] and step(94, 96) == []
    told = step(106, 108)
    assert told == ["every reward call failed for 3 steps in a row (reward/errors 106): the run learns from errors "
                    "scored 0, not from rewards; --strict_rewards stops at the first error and shows it"]
    assert step(118, 120) == []  # told once while it lasts
    assert Health(**vars(health)).totals == [118, 120]  # a resumed run counts its steps from the same totals


def test_a_reward_constant_at_a_higher_score_than_the_start_is_said_as_learned_in_one_line():
    """The quickstart's late steps: every completion scores 1.3 (up from 0.2): one line saying the task looks
    learned, not two (no spread is implied); a reward constant from the start keeps the check-the-reward line."""
    from llmrl.config import TrainConfig
    from llmrl.training.health import Health

    cfg, health = TrainConfig(health_steps=3), Health()
    flat = {"reward/min": 1.3, "reward/max": 1.3, "reward/mean": 1.3, "rollout/zero_spread_frac": 1.0}
    assert health.check(cfg, {"reward/min": 0.0, "reward/max": 1.3, "reward/mean": 0.2125}) == []
    assert health.check(cfg, flat) == [] and health.check(cfg, flat) == []
    assert health.check(cfg, flat) == ["every completion scored 1.3 for 3 steps in a row, up from a mean of 0.2125 at "
                                       "the first step: the task looks learned, and groups without spread give no "
                                       "gradient; stop here, or make the task harder"]
    stuck = Health()
    flat0 = {"reward/min": 0.3, "reward/max": 0.3, "reward/mean": 0.3, "rollout/zero_spread_frac": 1.0}
    assert [stuck.check(cfg, flat0) for _ in range(3)][-1] == [
        "every completion scored 0.3 for 3 steps in a row: no reward spread, nothing to learn from; check the reward "
        "function and the completions in samples.jsonl"]
