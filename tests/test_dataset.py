"""--dataset: gold answers in GSM8K's, MATH's and plain form, the three graders, held-out eval, TRL-signature
reward functions with weights, and the CLI end to end."""

import json

import pytest

from llmrl.config import load_config
from llmrl.errors import ConfigError, DataError
from llmrl.tasks import task_from_config
from llmrl.tasks.base import Example
from llmrl.tasks.dataset import DatasetTask, completion_number, completion_text, gold_answer, gold_number
from llmrl.tasks.score import score


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gold_answers_in_each_format():
    assert gold_answer("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    assert gold_answer("#### 1,234") == "1,234" and gold_number("1,234") == 1234.0
    assert gold_answer("so $x = \\boxed{\\frac{1}{2}}$ and \\boxed{\\dfrac{3}{4}}.") == "\\dfrac{3}{4}"  # the last box
    assert gold_answer("  Paris \n") == "Paris"
    assert gold_answer(7) == "7" and gold_answer(2.5) == "2.5"
    for missing in ("", "   ", "#### ", None, True, ["72"], {"a": 1}):
        assert gold_answer(missing) is None, missing
    assert gold_number("seventy") is None and gold_number("3/4") == 0.75


def test_completion_answers():
    assert completion_number("0.1 + 0.2 = 0.30000000000000004") == pytest.approx(0.3, rel=1e-15)
    assert completion_number("first 5, then \\boxed{12} and finally 13") == 12.0  # the box wins over the last number
    assert completion_number("no digits here") is None
    assert completion_text("I think\nthe answer is\n\\boxed{ Paris }") == "Paris"
    assert completion_text("line one\n  Rome  \n\n") == "Rome"


ROWS = [
    {"question": "Q1: 48 + 24?", "answer": "48 + 24 = 72\n#### 72"},  # GSM8K
    {"question": "Q2: half of one?", "answer": "It is \\boxed{\\frac{1}{2}}."},  # MATH
    {"question": "Q3: 0.1 + 0.2?", "answer": "0.3"},  # plain
    {"question": "Q4: a word?", "answer": "#### seventy"},  # no number: dropped by the number grader
    {"question": "Q5: nothing?", "answer": ""},  # no gold at all: dropped by every grader
    {"question": "", "answer": "1"},  # no prompt: dropped
    {"question": "Q7: 1,000 + 234?", "answer": "#### 1,234"},
]


def test_number_grader_reads_each_gold_format_and_drops_and_counts_the_unreadable(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    task = DatasetTask(seed=0, source=data, grader="number", eval_holdout=1)
    report = task.data_report
    assert report["prompt_field"] == "question" and report["answer_field"] == "answer"
    assert report["train"]["dropped"] == {"gold is not a number": 1, "no gold answer": 1, "no prompt": 1}
    kept = sorted(r["question"] for r in task.train_rows + task.eval_rows)
    assert kept == ["Q1: 48 + 24?", "Q2: half of one?", "Q3: 0.1 + 0.2?", "Q7: 1,000 + 234?"]
    assert len(task.eval_rows) == 1 and report["eval"] == {"held_out_of": "train", "rows": 1, "seed": 0}
    assert not {r["question"] for r in task.eval_rows} & {r["question"] for r in task.train_rows}
    by_q = {r["question"]: task.example(r) for r in task.train_rows + task.eval_rows}
    assert by_q["Q1: 48 + 24?"].messages[0]["role"] == "system" and by_q["Q1: 48 + 24?"].messages[-1] == {
        "role": "user", "content": "Q1: 48 + 24?"}
    cases = [("Q1: 48 + 24?", "so \\boxed{72}", 1.0), ("Q1: 48 + 24?", "72 or 73", 0.0),
             ("Q2: half of one?", "one half is 0.5", 1.0), ("Q3: 0.1 + 0.2?", "0.1 + 0.2 = 0.30000000000000004", 1.0),
             ("Q3: 0.1 + 0.2?", "0.31", 0.0), ("Q7: 1,000 + 234?", "\\boxed{1234}", 1.0), ("Q7: 1,000 + 234?", "", 0.0)]
    scores = score(task, [by_q[q] for q, _, _ in cases], [c for _, c, _ in cases], strict=True, where="test")
    assert [r.total for r in scores.rewards] == [want for _, _, want in cases]
    assert task.evaluate([by_q[q] for q, _, _ in cases], [c for _, c, _ in cases]) == {"correct": pytest.approx(4 / 7)}


def test_math_grader_uses_math_verify_and_drops_golds_it_cannot_read(tmp_path):
    rows = [{"problem": "P1", "solution": "so \\boxed{\\frac{1}{2}}"}, {"problem": "P2", "solution": "#### 72"},
            {"problem": "P3", "solution": "\\boxed{\\frac{1}{2}"}]  # unclosed box: the whole text, which math-verify reads
    data = write_jsonl(tmp_path / "m.jsonl", rows)
    task = DatasetTask(seed=1, source=data, grader="math", eval_holdout=1)
    assert task.data_report["prompt_field"] == "problem" and task.data_report["answer_field"] == "solution"
    ex = Example([{"role": "user", "content": "P1"}], "\\frac{1}{2}")
    rewards = task.reward_batch([ex, ex, ex], ["it is \\boxed{0.5}", "\\boxed{1/3}", "0.5 without a box"])
    assert [r.total for r in rewards] == [1.1, 0.1, 0.0]
    assert [r.components["correct"] for r in rewards] == [1.0, 0.0, 0.0]


def test_exact_grader_compares_the_boxed_or_last_line_after_collapsing_spaces(tmp_path):
    data = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "Capital of France?", "answer": "Paris"},
                                                {"prompt": "Two words?", "answer": "New  York"}])
    task = DatasetTask(seed=0, source=data, grader="exact", eval_holdout=1)
    fr = Example([], "Paris")
    ny = Example([], "New  York")
    got = [task.reward(fr, "I think\n\\boxed{ Paris }").total, task.reward(fr, "paris").total,
           task.reward(fr, "The capital is:\nParis").total, task.reward(ny, "\\boxed{New York}").total]
    assert got == [1.0, 0.0, 1.0, 1.0]


REWARDS = '''
def correct(prompts, completions, answer, **kwargs):
    """1 when the completion holds the gold's last token; None when the row has no answer."""
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(None if a is None else float(a.split()[-1] in text))
    return out


def length_penalty(prompts, completions, **kwargs):
    assert set(kwargs) >= {"answer", "level"} and len(kwargs["level"]) == len(completions)
    return [-0.1 * len(c[0]["content"] if isinstance(c, list) else c) for c in completions]
'''


@pytest.mark.parametrize("conversational", [False, True])
def test_trl_reward_functions_score_with_weights_and_none_is_unscored(tmp_path, conversational):
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": "say 7", "answer": "#### 7", "level": 1}, {"prompt": "say 8", "answer": None, "level": 2},
            {"prompt": "say 9", "answer": "9", "level": 3}]
    if conversational:
        for r in rows:
            r["prompt"] = [{"role": "user", "content": r["prompt"]}]
    data = write_jsonl(tmp_path / "f.jsonl", rows)
    cfg = load_config(None, {"dataset": data, "reward_funcs": f"{tmp_path}/rewards.py:correct,{tmp_path}/rewards.py:length_penalty",
                             "reward_weights": "1.0,0.3", "eval_holdout": 1, "system_prompt": "none"})
    assert cfg.task == "dataset"
    task = task_from_config(cfg)
    assert task.data_report["scored_by"] == ["correct", "length_penalty"]
    examples = [task.example(r) for r in task.train_rows + task.eval_rows]
    examples.sort(key=lambda ex: ex.messages[-1]["content"])
    assert examples[0].messages == [{"role": "user", "content": "say 7"}]  # system_prompt none: no system message
    texts = ["7 it is", "eight", "nine!"]
    scores = score(task, examples, texts, strict=True, where="test")
    r7, r8, r9 = scores.rewards
    assert r7.components == {"correct": 1.0, "length_penalty": pytest.approx(-0.7)}
    assert r7.total == pytest.approx(1.0 - 0.3 * 0.7)
    assert r8.components == {"length_penalty": pytest.approx(-0.5)} and r8.counts == {"unscored": 1}
    assert r8.total == pytest.approx(-0.3 * 0.5)
    assert r9.components == {"correct": 0.0, "length_penalty": pytest.approx(-0.5)} and r9.total == pytest.approx(-0.15)
    assert task.judge(examples, texts) is None  # functions say nothing about correctness: no pass@k


def test_dataset_options_are_checked_in_one_line(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ConfigError, match="grader='fuzzy': must be math, number or exact"):
        load_config(None, {"dataset": data, "grader": "fuzzy"})
    with pytest.raises(ConfigError, match="only with task dataset"):
        load_config(None, {"dataset": data, "task": "format_copy"})
    with pytest.raises(ConfigError, match="one weight per reward function"):
        load_config(None, {"dataset": data, "reward_funcs": "a.py:f", "reward_weights": "1,2"})
    with pytest.raises(ConfigError, match="'x' is not a number"):
        load_config(None, {"dataset": data, "reward_funcs": "a.py:f", "reward_weights": "x"})
    with pytest.raises(DataError, match="no column 'q' for the prompt"):
        task_from_config(load_config(None, {"dataset": data, "prompt_field": "q"}))
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        task_from_config(load_config(None, {"dataset": str(tmp_path / "rows.txt")}))
    with pytest.raises(DataError, match="no such file"):  # a path, not a hub id: no hub round trip
        task_from_config(load_config(None, {"dataset": str(tmp_path / "missing_dir_or_hub_id")}))
    with pytest.raises(DataError, match="no such file"):  # a data file's suffix, relative
        task_from_config(load_config(None, {"dataset": "train_rows.parquet"}))
    with pytest.raises(DataError, match="could not load it"):  # owner/name: the hub, unreachable here
        task_from_config(load_config(None, {"dataset": "no-such-owner-xyz/no-such-data"}))


@pytest.mark.slow
def test_a_gsm8k_format_file_trains_two_steps_with_math_verify_and_evaluates(tmp_path, tiny_model_dir):
    from pathlib import Path

    from helpers import cli, read_jsonl, tiny_args

    small = Path(__file__).resolve().parents[1] / "examples" / "gsm8k" / "small.jsonl"
    out = tmp_path / "run"
    args = tiny_args(tiny_model_dir, out, "grpo", steps=2, task="dataset", max_prompt_tokens=128, eval_interval=2, eval_n=4)
    cli(*args, "--dataset", str(small), "--grader", "math", "--eval_holdout", "8")
    report = json.loads((out / "data_report.json").read_text())
    assert report["train"]["kept"] == 232 and report["eval"]["rows"] == 8
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/correct" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["eval/correct"] <= 1.0 for r in evals)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(train) == 2 and "reward/correct" in train[0] and "reward/boxed" in train[0]
    rows = read_jsonl(out / "eval_samples.jsonl")
    assert rows and rows[0]["prompt"].endswith("?") and rows[0]["answer"].isdigit()


def test_a_run_dirs_reward_functions_are_code_it_does_not_run_unasked(tmp_path):
    from llmrl.errors import UserError
    from llmrl.tasks import check_task_code, resume_command

    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = load_config(None, {"dataset": data, "reward_funcs": "r.py:f"})
    with pytest.raises(UserError, match=r"run dir R names reward function 'r.py:f' \(a file it would import\)"):
        check_task_code(cfg, "R", False)
    check_task_code(cfg, "R", True)
    assert resume_command(cfg, "R") == "llmrl train --resume R --trust_task_code"
    assert resume_command(load_config(None, {"dataset": data}), "R") == "llmrl train --resume R"
