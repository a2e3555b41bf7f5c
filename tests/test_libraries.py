"""Environment libraries by name (`--task LIBRARY:NAME`): llmrl's reward equals the library's own scoring."""

import pytest

from llmrl.errors import ConfigError
from llmrl.tasks import is_task_code, is_task_name, make_task
from llmrl.tasks.score import score

rg = pytest.importorskip("reasoning_gym")


def test_reasoning_gym_reward_is_its_own_scoring_on_right_wrong_partial_and_untagged_replies():
    from reasoning_gym.utils import extract_answer

    task = make_task("reasoning_gym:spell_backward", seed=3, task_args={"size": 40, "eval_size": 20})
    ds = rg.create_dataset("spell_backward", size=40, seed=3)
    examples = task.eval_examples(3) + task.sample_train_batch(3)
    for ex in examples:
        answer = ex.answer
        replies = {"right": f"thinking...\n<answer>{answer}</answer>", "wrong": "<answer>zzzz</answer>",
                   "partial": f"<answer>{answer[:-1]}x</answer>", "untagged": answer,
                   "longer": f"<answer>{answer} indeed</answer>"}
        got = {k: task.reward(ex, r).total for k, r in replies.items()}
        item = ex.meta["item"]
        want = {k: float(ds.score_answer(extract_answer(r), item)) for k, r in replies.items()}
        assert got == want
        assert got["right"] == 1.0 and got["untagged"] == 0.0 and got["wrong"] == 0.0
        assert 0.0 < got["partial"] < 1.0  # spell_backward's partial credit: a near miss
    train_items = {ex.meta["item"]["question"] for ex in task.sample_train_batch(40)}
    assert all(item["question"] in {ds[i]["question"] for i in range(40)} for item in (ex.meta["item"] for ex in examples[3:]))
    assert not {ex.meta["item"]["question"] for ex in task.eval_examples(20)} & {ds[i]["question"] for i in range(40)}
    assert train_items


def test_a_mixture_logs_each_datasets_score_and_full_credit_only_counts_for_pass_at_k():
    task = make_task("reasoning_gym:chain_sum,spell_backward", seed=0,
                     task_args={"size": 30, "eval_size": 10, "weights": {"chain_sum": 3.0}})
    assert not is_task_code("reasoning_gym:chain_sum,spell_backward") and is_task_name("reasoning_gym:chain_sum")
    evals = task.eval_examples(4)
    assert [ex.meta["dataset"] for ex in evals] == ["chain_sum", "spell_backward"] * 2  # interleaved
    replies = [f"<answer>{ex.answer}</answer>" if i % 2 == 0 else f"<answer>{ex.answer}!!</answer>"
               for i, ex in enumerate(evals)]
    scores = score(task, evals, replies, strict=True, where="test")
    assert scores.rewards[0].metrics == {"chain_sum": 1.0} and scores.rewards[0].total == 1.0
    assert scores.rewards[1].metrics.keys() == {"spell_backward"} and 0 < scores.rewards[1].total < 1
    metrics = task.evaluate(evals, replies)
    assert metrics["chain_sum/correct"] == 1.0 and metrics["spell_backward/correct"] == 0.0
    assert metrics["correct"] == 0.5 and metrics["score"] == pytest.approx(sum(r.total for r in scores.rewards) / 4)
    assert [j.correct for j in task.judge(evals, replies)] == [True, False, True, False]
    picked = [ex.meta["dataset"] for ex in task.sample_train_batch(400)]
    assert 0.65 < picked.count("chain_sum") / 400 < 0.85  # weights 3:1 → 0.75 (±0.1 is > 4 binomial sd)


def test_reasoning_gym_mistakes_are_one_line():
    with pytest.raises(ConfigError, match="no dataset 'no_such_set'"):
        make_task("reasoning_gym:no_such_set", seed=0)
    with pytest.raises(ConfigError, match="cannot take task_args"):
        make_task("reasoning_gym:chain_sum", seed=0, task_args={"sizes": 3})
    with pytest.raises(ConfigError, match="create_dataset raised"):
        make_task("reasoning_gym:chain_sum", seed=0, task_args={"configs": {"chain_sum": {"min_terms": "x"}}})
