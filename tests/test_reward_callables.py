"""Reward functions given as themselves from Python (TRL's way), checked at start on one real row, and llmrl.rewards:
a function with another signature or return shape stops in one line; callables pass as reward_funcs, task and
environment_factory; a run made with one resumes from Python with it given again, and says so in one line without."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import llmrl
from llmrl.config import load_config, save_config
from llmrl.errors import ConfigError
from llmrl.rewards import accuracy, exact_match, overlong_penalty, soft_overlong_punishment, think_format
from llmrl.tasks import check_task_code, resume_command, task_from_config
from llmrl.tasks.custom import PYTHON_OBJECTS
from llmrl.tasks.score import score

ROWS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b), "level": a} for a, b in [(2, 3), (4, 4), (7, 1)]]


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def config(rows, reward_funcs, **options):
    return load_config(None, {"dataset": rows, "reward_funcs": reward_funcs, "eval_holdout": 1, **options})


def correct(completion, answer):  # the report's function: TRL calls it with prompts=, completions=, answer=, ...
    return float(answer in completion)


def mentions(prompts, completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]


def one_value(prompts, completions, **kwargs):
    return 0.5


def test_the_reports_wrong_signature_stops_in_one_line_naming_the_function_and_the_fix(rows):
    cfg = config(rows, [correct])
    with pytest.raises(ConfigError) as e:
        task_from_config(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("reward_funcs: correct(completion, answer) must take (prompts, completions, **columns), "
                              "the keywords TRL's signature calls it with (here prompts, completions and the columns "
                              "answer, level): missing a required argument: 'completion'; write it as "
                              "def correct(prompts, completions, **kwargs)"), message


@pytest.mark.parametrize("returns, said", [
    ("0.5", "returned 0.5 (a float), not a list"),
    ("[1.0]", "returned 1 value for 2 completions"),
    ("[1.0, 'yes']", "returned a list holding 'yes' (a str), not a number or None"),
])
def test_a_wrong_return_shape_stops_in_one_line(rows, returns, said):
    def reward(prompts, completions, **kwargs):
        return eval(returns)

    with pytest.raises(ConfigError) as e:
        task_from_config(config(rows, [reward]))
    assert str(e.value) == (f"reward_funcs: reward {said}; it must return a list with a float or None for each "
                            "completion (TRL's signature: f(prompts, completions, **columns) -> list[float | None])")


def test_a_function_that_raises_on_the_start_rows_completions_stops_and_one_that_overruns_warns(rows, capsys):
    def last_word(prompts, completions, **kwargs):
        return [float(c.split()[-1] == "8") for c in completions]  # IndexError on the empty completion

    with pytest.raises(ConfigError, match=r"^reward_funcs: last_word raised IndexError: list index out of range on the "
                                          r"first training row with the completions \['', 'The answer is "):
        task_from_config(config(rows, [last_word]))

    def slow(prompts, completions, **kwargs):
        time.sleep(10)
        return [0.0] * len(completions)

    t0 = time.monotonic()
    task = task_from_config(config(rows, [slow, mentions], user_code_timeout=0.5))
    assert time.monotonic() - t0 < 8  # abandoned at the limit; the run goes on
    err = capsys.readouterr().err
    assert "llmrl: warning: reward_funcs: slow did not score the first training row with the completions ['', " in err
    assert "] within user_code_timeout (timeout after 0.5 s" in err
    assert [n for n, _, _ in task.funcs] == ["slow", "mentions"]


def test_callables_pass_the_start_check_and_score_under_their_names(rows):
    def short(prompts, completions, **kwargs):
        return [None if not c else -len(c) / 10 for c in completions]

    overlong = soft_overlong_punishment(max_length=8, cache=4)
    cfg = config(rows, [mentions, short, exact_match, overlong], reward_weights=[1, 1, 1, 1])
    assert cfg.reward_funcs == ["test_reward_callables:mentions",  # imports again by that name: an ordinary spec
                                "<python: test_reward_callables.test_callables_pass_the_start_check_and_score_under_"
                                "their_names.<locals>.short>",
                                "llmrl.rewards:exact_match",
                                "<python: llmrl.rewards.soft_overlong_punishment(max_length=8, cache=4)>"]
    task = task_from_config(cfg)
    assert task.data_report["scored_by"] == ["mentions", "short", "exact_match", "soft_overlong_punishment"]
    example = next(task.example(r) for r in task.train_rows + task.eval_rows if r["answer"] == "8")
    scores = score(task, [example, example], ["it is 8", "\\boxed{9}"], strict=True, where="test")
    first, second = scores.rewards
    # "it is 8": 7 characters, 1 over max_length - cache = 4: (4 - 7) / 4 = -0.75; its last line "it is 8" is not "8"
    assert first.components == {"mentions": 1.0, "short": pytest.approx(-0.7), "exact_match": 0.0,
                                "soft_overlong_punishment": -0.75}
    # "\boxed{9}": 9 characters, past max_length 8: -1
    assert second.components == {"mentions": 0.0, "short": pytest.approx(-0.9), "exact_match": 0.0,
                                 "soft_overlong_punishment": -1.0}
    assert second.total == pytest.approx(-1.9)


def test_two_callables_with_one_name_are_refused():
    with pytest.raises(ConfigError, match=r"^reward_funcs: two callables are both <python: .*<lambda>>; give each its "
                                          r"own name"):
        load_config(None, {"dataset": "x.jsonl", "reward_funcs": [lambda p, c, **k: [0.0] * len(c),
                                                                  lambda p, c, **k: [1.0] * len(c)]})


def test_a_plain_reward_function_or_a_task_class_as_task(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi.", "level": 1}\n')

    def brevity(prompt, completion, **meta):
        return 1.0 - len(completion) / 10

    task = task_from_config(load_config(None, {"task": brevity, "prompts": str(prompts)}))
    assert task.reward(task.sample_train_batch(1)[0], "abc").total == pytest.approx(0.7)
    with pytest.raises(ConfigError, match=r"^task='<python: .*\.correct>': correct\(completion, answer\) must take "
                                          r"\(prompt, completion, \*\*fields\), .*got an unexpected keyword argument "
                                          r"'level'; a TRL-signature"):
        def correct(completion, answer):
            return 1.0

        task_from_config(load_config(None, {"task": correct, "prompts": str(prompts)}))
    with pytest.raises(ConfigError, match=r"returned \[0\.5\] \(a list\) for one completion; a plain reward function "
                                          r"returns a float or None; a TRL-signature"):
        task_from_config(load_config(None, {"task": lambda prompts, completions, **kw: [0.5], "prompts": str(prompts)}))
    from toy_task import CharTask

    cfg = load_config(None, {"task": CharTask})
    assert cfg.task == "toy_task:CharTask" and task_from_config(cfg).reward(CharTask.example(0), "abc").total >= 0


class Counter:
    """An environment_factory class given from Python."""

    def reset(self, **row):
        self.count = 0

    def add(self, k: int) -> str:
        """Add to the count.

        Args:
            k: how much to add
        """
        self.count += k
        return str(self.count)


def test_an_environment_factory_class_and_its_reward_functions_signatures(rows):
    def reached(prompts, completions, environments, answer, **kwargs):
        return [float(str(e.count) == a) for e, a in zip(environments, answer)]

    env = task_from_config(config(rows, [reached], environment_factory=Counter, env_isolation="thread"))
    assert env.factory is Counter and env.funcs[0][0] == "reached"
    with pytest.raises(ConfigError, match=r"^reward_funcs: correct\(completion, answer\) must take .*the columns "
                                          r"answer, level, environments\)"):
        task_from_config(config(rows, [correct], environment_factory=Counter, env_isolation="thread"))


def test_a_run_dir_naming_a_notebooks_function_says_to_give_it_again_and_resumes_with_it(rows, tmp_path):
    def reward(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    run = tmp_path / "run"
    run.mkdir()
    cfg = config(rows, [reward, "llmrl.rewards:think_format"], output_dir=str(run))
    marker = cfg.reward_funcs[0]
    assert marker.startswith("<python: test_reward_callables.") and marker.endswith(".<locals>.reward>")
    save_config(cfg, run / "config.yaml")
    assert f"- '{marker}'" in (run / "config.yaml").read_text()
    assert resume_command(cfg, run) == (f"llmrl.train(llmrl.load_config('{run / 'config.yaml'}', "
                                        "{'reward_funcs': [reward, 'llmrl.rewards:think_format']}), resume=True)")
    del PYTHON_OBJECTS[marker]  # as in another process
    again = load_config(run / "config.yaml")
    line = (f"reward_funcs: {marker} names a Python object given to llmrl.load_config, which a config file cannot "
            f"hold: give it again, e.g. llmrl.load_config('{run / 'config.yaml'}', {{'reward_funcs': [reward, ...]}})")
    with pytest.raises(ConfigError) as e:
        check_task_code(again, run, trusted=True)
    assert str(e.value) == line
    with pytest.raises(ConfigError) as e:
        task_from_config(again)
    assert str(e.value) == line
    given = load_config(run / "config.yaml", {"reward_funcs": [reward, "llmrl.rewards:think_format"]})
    assert given.reward_funcs == cfg.reward_funcs  # the same config: a resume's check finds no difference
    check_task_code(given, run, trusted=False)  # given in this process: the user's own; llmrl.rewards is llmrl's
    assert task_from_config(given).funcs[0][1] is reward
    p = subprocess.run([sys.executable, "-m", "llmrl", "train", "--resume", str(run)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and p.stderr == f"llmrl: error: {line}\n", p.stderr[-2000:]


def test_the_cli_stops_a_wrong_signature_in_one_line_before_the_model_loads(tmp_path, rows, tiny_model_dir):
    from helpers import run_cli, tiny_args

    (tmp_path / "rewards.py").write_text("def correct(completion, answer):\n    return float(answer in completion)\n")
    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", task="dataset"), "--dataset", rows,
                "--reward_funcs", f"{tmp_path}/rewards.py:correct", "--eval_holdout", "1")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("llmrl: error: reward_funcs: correct(completion, answer) "
                                                             "must take (prompts, completions, **columns)"), p.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------- llmrl.rewards


def test_soft_overlong_punishment_is_dapos_in_characters_or_tokens():
    # max_length 100, cache 20: free up to 80, then (80 - L) / 20, -1 past 100
    assert [overlong_penalty(n, 100, 20) for n in (0, 80, 81, 87, 93, 100, 101, 5000)] == \
           [0.0, 0.0, -0.05, -0.35, -0.65, -1.0, -1.0, -1.0]
    assert overlong_penalty(3, 10, 10) == pytest.approx(-0.3)  # cache = max_length: falls from length 0
    punish = soft_overlong_punishment(max_length=7, cache=3)  # free up to 4 characters
    assert punish.__name__ == "soft_overlong_punishment"
    assert punish(None, ["abcd", "abcdef", [{"role": "assistant", "content": "abcde"}], "abcdefgh"]) == \
           pytest.approx([0.0, -2 / 3, -1 / 3, -1.0])

    class Words:  # a tokenizer whose tokens are words
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return text.split()

    in_tokens = soft_overlong_punishment(max_length=5, cache=2, tokenizer=Words())  # free up to 3 words
    assert in_tokens(None, ["one two three", "a b c d", "a b c d e", "a b c d e f"]) == [0.0, -0.5, -1.0, -1.0]
    for bad in (dict(max_length=0, cache=1), dict(max_length=10, cache=0), dict(max_length=10, cache=11),
                dict(max_length=10.0, cache=2)):
        with pytest.raises(ValueError, match="soft_overlong_punishment: "):
            soft_overlong_punishment(**bad)


def test_think_format_accuracy_and_exact_match():
    texts = ["<think>2+2 is 4</think>\\boxed{4}", "  <think>a</think>\n4", "<think>a</think>   ", "4",
             "<think>a<think>b</think>4", "<think>a</think>4</think>",
             [{"role": "assistant", "content": "<think>x</think>y"}]]
    assert think_format(None, texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    completions = ["so \\boxed{\\frac{1}{2}}", "0.5", "\\boxed{5}", "\\boxed{7}"]
    golds = ["#### 0.5", "1/2", "The sum is \\boxed{5}.", None]
    assert accuracy(None, completions, answer=golds) == [1.0, 0.0, 1.0, None]
    assert accuracy(None, completions[:1], solution=["$\\boxed{0.5}$"]) == [1.0]
    with pytest.raises(ValueError, match="accuracy reads the gold answer from a column `answer` or `solution`"):
        accuracy(None, completions, question=["q"] * 4)
    assert exact_match(None, ["I think\n\\boxed{ New  York }", "The capital:\nParis", "paris"],
                       answer=["New York", "#### Paris", "Paris"]) == [1.0, 1.0, 0.0]


def test_llmrl_exports_the_api_and_the_rewards_module():
    names = dir(llmrl)
    assert {"train", "load_config", "Environment", "rewards", "evaluate"} <= set(names)
    assert llmrl.rewards.accuracy is accuracy


@pytest.mark.slow
def test_the_notebook_example_trains_two_steps_with_a_function_defined_inline(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "notebook_rewards.py"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(example), str(tmp_path)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.monotonic() - t0 < 150
    assert "refused: reward_funcs: correct(completion, answer) must take (prompts, completions, **columns)" in p.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert 0.0 <= r["reward/mentions_answer"] <= 1.0 and -1.0 <= r["reward/soft_overlong_punishment"] <= 0.0
        weighted = r["reward/mentions_answer"] + 0.5 * r["reward/soft_overlong_punishment"]
        assert r["reward/mean"] == pytest.approx(weighted)
        assert r["reward/errors"] == 0
    written = (tmp_path / "run" / "config.yaml").read_text()
    assert "- '<python: __main__.mentions_answer>'" in written
    assert "- '<python: llmrl.rewards.soft_overlong_punishment(max_length=100, cache=40)>'" in written
