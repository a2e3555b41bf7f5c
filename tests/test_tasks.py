"""Rewards and eval metrics of both tasks on crafted completions."""

import random
from pathlib import Path

import pytest

from llmrl.tasks import make_task
from llmrl.tasks.format_copy import FormatCopyTask, grade
from llmrl.tasks.math_hard import MathHardTask
from llmrl.tasks.seed_parsing import last_boxed, last_number, parse_number

FIXTURE = Path(__file__).parent / "fixtures" / "math_tiny.jsonl"


@pytest.mark.parametrize("text, target, expected", [
    ("<answer>4348</answer>", 4348, 1.3),
    ("  <answer>4348</answer>\n", 4348, 1.3),
    ("<ANSWER>4348</Answer>", 4348, 1.3),  # case-insensitive tag
    ("<answer>-4,348</answer>", -4348, 1.3),  # thousands separator, negative
    ("<answer>\n-17\n</answer>", -17, 1.3),  # tag spans lines
    ("Here is the answer: <answer>4348</answer>", 4348, 1.2),  # extra text: not strict
    ("<answer>4349</answer>", 4348, 0.3),  # wrong number: tag + strict
    ("<answer>The number is 12 then 4348</answer>", 4348, 1.3),  # not a plain number: last number inside
    ("<answer>4348</answer><answer>1</answer>", 4348, 1.3),  # two tags: first counts; starts and ends with a tag: strict
    ("<answer><answer>4348</answer></answer>", 4348, 1.3),  # nested: first content "<answer>4348", its last number
    ("<answer>.42</answer>", 42, 0.3),  # .42 is the number 0.42
    ("<answer>84/2</answer>", 42, 1.3),  # a fraction is a number
    ("<answer>\\frac{84}{2}</answer>", 42, 1.3),
    ("<answer>4,2</answer>", 42, 1.3),  # every comma is removed
    ("<answer>42.0000001</answer>", 42, 1.3),  # within 1e-6
    ("<answer>42.00001</answer>", 42, 0.3),
    ("<answer>$42$</answer>", 42, 1.3),
    ("<answer>1</answer> <answer>4348</answer>", 4348, 0.3),  # first tag is wrong (strict: starts and ends with a tag)
    ("<answer>4348", 4348, 0.0),  # unclosed
    ("4348", 4348, 0.0),  # no tag
    ("<think>maybe <answer>1</answer></think><answer>4348</answer>", 4348, 1.3),  # think removed first
    ("<think>hmm</think>\n<answer>4348</answer>", 4348, 1.3),
    ("<answer>4348.0</answer>", 4348, 1.3),
    ("<answer>43,48</answer>", 4348, 1.3),  # commas removed: 4348
    ("<answer>is 43,48</answer>", 4348, 0.3),  # not a plain number: its last number, 48
    ("<answer></answer>", 5, 0.3),
    ("<answer>+5</answer>", 5, 1.3),
])
def test_format_copy_reward(text, target, expected):
    r = FormatCopyTask().reward(FormatCopyTask.example(target), text)
    assert r.total == pytest.approx(expected)
    assert r.total == pytest.approx(sum(r.components.values()))


def test_format_copy_components_and_eval():
    task = FormatCopyTask()
    r = task.reward(task.example(7), "ok <answer>7</answer>")
    assert r.components == {"has_tag": 0.2, "strict": 0.0, "exact": 1.0}
    exs = [task.example(1), task.example(2)]
    m = task.evaluate(exs, ["<answer>1</answer>", "x <answer>3</answer>"])
    assert m == {"exact_match": 0.5, "has_tag": 1.0, "strict": 0.5}


def test_format_copy_prompt_and_sampling_are_seeded():
    a, b = FormatCopyTask(seed=3), FormatCopyTask(seed=3)
    ta = [e.answer for e in a.sample_train_batch(5)]
    assert ta == [e.answer for e in b.sample_train_batch(5)]
    assert all(-5000 <= t <= 5000 for t in ta)
    assert ta != [e.answer for e in FormatCopyTask(seed=4).sample_train_batch(5)]
    ex = a.sample_train_batch(1)[0]
    assert ex.messages[0]["content"].startswith("You are a strict formatter.\nReturn the final answer as XML")
    assert ex.messages[1]["content"] == f"Copy this integer exactly: {ex.answer}"
    # eval targets: random.Random(seed + 123), the starter's (Random(123) at seed 0)
    rng = random.Random(123)
    assert [e.answer for e in FormatCopyTask(seed=0).eval_examples(5)] == [rng.randint(-5000, 5000) for _ in range(5)]
    rng = random.Random(126)
    assert [e.answer for e in a.eval_examples(4)] == [rng.randint(-5000, 5000) for _ in range(4)]


def test_format_copy_state_round_trip():
    a = FormatCopyTask(seed=1)
    a.sample_train_batch(3)
    state = a.state_dict()
    nxt = [e.answer for e in a.sample_train_batch(4)]
    b = FormatCopyTask(seed=99)
    b.load_state_dict(state)
    assert [e.answer for e in b.sample_train_batch(4)] == nxt


def test_grade_is_shared():
    g = grade("<answer>5</answer>", 5)
    assert (g.has_tag, g.strict, g.exact) == (True, True, True)


@pytest.mark.parametrize("s, value", [
    ("42", 42.0), ("-3", -3.0), ("0.25", 0.25), (".5", 0.5), ("3/4", 0.75), ("\\frac{3}{4}", 0.75),
    ("\\dfrac{1}{8}", 0.125), ("-\\frac{1}{2}", -0.5), ("2\\frac{1}{2}", 2.5), ("\\text{ 12 }", 12.0),
    ("10,000", 10000.0), ("10,\\!000", None), ("$7$", 7.0), ("\\$18.90", 18.9), ("\\$1,000", 1000.0), ("2 1/2", 2.5),
    ("-2 1/2", -2.5), ("{5}", 5.0), ("{{5}}", None), ("1,2", 12.0), ("\\text{\\text{7}}", 7.0), ("\\left5\\right", 5.0),
    ("\\sqrt{2}", None), ("(1,2)", None), ("x+1", None), ("\\frac{\\sqrt3}{2}", None), ("1/0", None), ("", None),
    ("1e3", None), ("5.", None),
])
def test_parse_number(s, value):
    assert parse_number(s) == (pytest.approx(value) if value is not None else None)


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} and \\boxed{2") == "1"  # last one is unclosed: the one before
    assert last_boxed("\\boxed{3}<think>\\boxed{5}</think>") == "3"  # think blocks removed first
    assert last_boxed("no box") is None
    assert last_number("x = 3, y = -4.5 so 1,234") == 1234.0
    assert last_number("12 <think>13</think>") == 12.0


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{12}", 1.1),
    ("so the answer is \\boxed{\\frac{24}{2}}", 1.1),
    ("\\boxed{13}", 0.1),  # boxed but wrong
    ("\\boxed{13} hmm actually 12", 0.1),  # the boxed answer is a number (wrong): no relaxed credit
    ("\\boxed{x} hmm actually 12", 0.2),  # the boxed answer is no number: the last number counts
    ("\\BOXED{12}", 0.2),  # the format bonus ignores case, the boxed answer does not: relaxed credit
    ("\\boxed{3}<think>\\boxed{12}</think>", 0.1),
    ("\\boxed{\\$12}", 1.1),
    ("The answer is 12", 0.1),  # relaxed credit only
    ("The answer is 13", 0.0),
    ("\\boxed{12", 0.2),  # unclosed box: contains \boxed{ and last number is 12
    ("\\boxed{12} \\boxed{1", 1.1),  # unclosed last box: the closed one before
    ("\\boxed{12.0000001}", 1.1),  # within 1e-6
    ("\\boxed{12.001}", 0.1),
])
def test_math_reward(text, expected):
    task = MathHardTask(data=str(FIXTURE))
    ex = task.example({"problem": "p", "gold": 12.0, "gold_text": "12"})
    r = task.reward(ex, text)
    assert r.total == pytest.approx(expected)


def test_math_fixture_filtering_and_eval():
    task = make_task("math_hard", seed=0, math_data=str(FIXTURE))
    # train: 3 level-5 numeric rows (one level 3, one sqrt answer, 10,\!000, one empty problem dropped)
    assert len(task.train_rows) == 3
    assert [r["gold"] for r in task.test_rows] == [5.0, 0.5, -2.0]
    exs = task.eval_examples(2)
    assert exs[0].messages[1]["content"].endswith("\n\nReturn only: \\boxed{NUMBER}")
    assert exs[0].messages[0]["content"].startswith("Solve the competition-level math problem.\n")
    m = task.evaluate(exs, ["\\boxed{5}", "it is 0.5"])
    assert m == {"boxed_exact": 0.5, "relaxed_exact": 1.0, "boxed_rate": 0.5}
    batch = task.sample_train_batch(6)
    assert {e.answer for e in batch} <= {r["gold"] for r in task.train_rows}


EXAMPLES = Path(__file__).parent.parent / "examples"


def test_registered_reward_function_and_its_errors(monkeypatch):
    from llmrl.errors import ConfigError
    from llmrl.tasks import make_task, register_reward
    from llmrl.tasks.custom import REWARD_FUNCTIONS

    def shout(prompt, completion, keyword="", **meta):
        return None if not completion else float(completion.isupper())

    monkeypatch.setitem(REWARD_FUNCTIONS, "shout", None)  # the registry loses "shout" again after the test
    assert register_reward("shout", prompts=str(EXAMPLES / "brevity_prompts.jsonl"))(shout) is shout

    task = make_task("shout", seed=0)
    ex = task.eval_examples(8)[6]
    assert ex.messages[0] == {"role": "system", "content": "Answer in one word."} and ex.meta == {"keyword": "cold"}
    assert task.reward(ex, "COLD").total == 1.0 and task.reward(ex, "").counts == {"unscored": 1}
    with pytest.raises(ConfigError, match="--prompts"):
        make_task(f"{EXAMPLES / 'brevity_reward.py'}:reward", seed=0)
    with pytest.raises(ConfigError, match="has no nothing"):
        make_task(f"{EXAMPLES / 'brevity_reward.py'}:nothing", seed=0)
