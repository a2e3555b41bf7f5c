"""Weighted task mixtures (`--task a,b`, tasks/mixture.py): draws by weight, each example scored and evaluated by
its own task, the state a checkpoint keeps, one-line refusals."""

import json

import pytest

from llmrl.errors import ConfigError
from llmrl.tasks import is_single_task_name, is_task_code, is_task_name, make_task
from llmrl.tasks.mixture import MixtureTask, mixture_parts
from llmrl.tasks.score import score

MIX = "format_copy,toy_task:CharTask"


def test_names_split_at_commas_and_a_librarys_own_list_stays_whole():
    assert mixture_parts("format_copy,math_hard", is_single_task_name) == ["format_copy", "math_hard"]
    assert mixture_parts("reasoning_gym:chain_sum,spell_backward,format_copy", is_single_task_name) == [
        "reasoning_gym:chain_sum,spell_backward", "format_copy"]
    assert mixture_parts("reasoning_gym:chain_sum,spell_backward", is_single_task_name) is None  # one library task
    assert mixture_parts("format_copy", is_single_task_name) is None
    assert not is_task_name("format_copy,no_such_task") and is_task_name(MIX)
    assert not is_task_code("format_copy,math_hard") and is_task_code("format_copy,my.module:Task")


def test_prompts_follow_the_weights_and_each_is_scored_and_evaluated_by_its_own_task():
    """Weights 3 : 1 over 3,003 draws of 7 (not a power of two): the share of format_copy is 3/4 within 5
    binomial standard deviations (sqrt(3003 * 3/16) = 23.7 draws); every reward is its task's own, with the
    total as the metric named after the task; eval metrics are per task."""
    mix = make_task(MIX, seed=11, task_args={"weights": {"format_copy": 3}})
    own = {"format_copy": make_task("format_copy", seed=0), "toy_task:CharTask": make_task("toy_task:CharTask", seed=0)}
    drawn = [ex for _ in range(429) for ex in mix.sample_train_batch(7)]
    share = sum(ex.source == "format_copy" for ex in drawn)
    assert abs(share - 0.75 * len(drawn)) <= 5 * (len(drawn) * 3 / 16) ** 0.5
    examples = drawn[:20]
    texts = [f"<answer>{ex.answer}</answer>" if k % 3 else "no tags, some text 0.1" for k, ex in enumerate(examples)]
    rewards = score(mix, examples, texts, strict=True, where="test").rewards
    for ex, text, r in zip(examples, texts, rewards):
        expected = own[ex.source].reward(ex, text)
        assert (r.total, r.components) == (expected.total, expected.components)
        assert r.metrics == {ex.source: expected.total}
    ev = mix.eval_examples(5)
    assert [ex.source for ex in ev] == ["format_copy", "toy_task:CharTask"] * 2 + ["format_copy"]
    metrics = mix.evaluate(ev, ["<answer>x</answer>"] * 5)
    assert set(metrics) == {f"format_copy/{k}" for k in own["format_copy"].evaluate(ev[0::2], ["<answer>x</answer>"] * 3)} | {
        "toy_task:CharTask/distinct"}


def test_a_mixtures_state_survives_a_checkpoint_as_json():
    a = make_task(MIX, seed=5, task_args={"weights": {"toy_task:CharTask": 0.7}})
    a.sample_train_batch(9)
    state = json.loads(json.dumps(a.state_dict()))  # trainer_state.json
    b = make_task(MIX, seed=99, task_args={"weights": {"toy_task:CharTask": 0.7}})
    b.load_state_dict(state)
    after_a, after_b = a.sample_train_batch(13), b.sample_train_batch(13)
    assert [(e.source, e.answer, e.messages) for e in after_a] == [(e.source, e.answer, e.messages) for e in after_b]


def test_bad_mixtures_are_one_line():
    with pytest.raises(ConfigError, match="guess is an environment"):
        make_task("format_copy,guess", seed=0)
    with pytest.raises(ConfigError, match=r"weights name tasks outside the mixture"):
        make_task(MIX, seed=0, task_args={"weights": {"math_hard": 1}})
    with pytest.raises(ConfigError, match="is neither"):
        make_task(MIX, seed=0, task_args={"level": 3})
    with pytest.raises(ConfigError, match="not all 0"):
        make_task(MIX, seed=0, task_args={"weights": {"format_copy": 0, "toy_task:CharTask": 0}})
    assert isinstance(make_task(MIX, seed=0), MixtureTask)


@pytest.mark.slow
def test_a_mixture_trains_and_logs_each_tasks_reward_and_eval_metrics(tmp_path, tiny_model_dir):
    from helpers import cli, read_jsonl, tiny_args

    out = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=MIX, eval_n=4, eval_interval=2))
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert any("reward/format_copy" in r or "reward/toy_task:CharTask" in r for r in train)
    evals = [r for r in records if "eval/reward" in r]
    assert all("eval/toy_task:CharTask/distinct" in r and any(k.startswith("eval/format_copy/") for k in r) for r in evals)
