"""A `--dataset` run a new user starts on a 2-core CPU (issue 58): CPU-sized shapes said in one line, a hold-out that
leaves most rows to train on, a one-line stop when the rows do not fill a batch, and one warning when the grader
reads no answer in most completions, naming the grader that would."""

import json

import pytest

from llmrl.config import CPU_DATASET_SHAPES, TrainConfig, cpu_dataset_shapes, load_config
from llmrl.errors import ConfigError
from llmrl.tasks.dataset import DatasetTask, check_train_rows, holdout_size, unread_hint
from llmrl.training.health import Health


def gsm8k_rows(path, n):
    """n GSM8K-style rows: question i, answer '... #### 2i'."""
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_dataset_run_on_cpu_takes_cpu_shapes_said_in_one_line(tmp_path):
    data = gsm8k_rows(tmp_path / "rows.jsonl", 30)
    notes = []
    cfg = load_config(None, {"dataset": data, "device": "cpu"}, notes=notes)
    assert (cfg.batch_size, cfg.group_size, cfg.max_new_tokens, cfg.eval_n, cfg.eval_holdout) == (4, 4, 128, 16, 16)
    assert cfg.min_new_tokens == 1 and cfg.minibatch_size == 8  # other fields keep their defaults (8 divides 4 × 4)
    assert (cfg.steps, cfg.lr, cfg.warmup_steps, cfg.eval_interval, cfg.save_interval) == (20, 2e-4, 3, 10, 10)
    assert notes == ["llmrl: CPU defaults for --dataset: batch_size 4, group_size 4, max_new_tokens 128, eval_n 16, "
                     "eval_holdout 16, steps 20, lr 0.0002, warmup_steps 3, eval_interval 10, save_interval 10 "
                     "(configs/quickstart.yaml's 4 prompts × 4 completions with room for a worked answer, "
                     "examples/gsm8k/cpu.yaml's schedule); give --config or these flags to change"]


def test_flags_given_win_over_the_cpu_shapes_and_the_line_names_only_the_rest(tmp_path):
    data = gsm8k_rows(tmp_path / "rows.jsonl", 30)
    notes = []
    cfg = load_config(None, {"dataset": data, "device": "cpu", "batch_size": "2", "max_new_tokens": "64",
                             "eval_holdout": "3"}, notes=notes)
    assert (cfg.batch_size, cfg.group_size, cfg.max_new_tokens, cfg.eval_n, cfg.eval_holdout) == (2, 4, 64, 16, 3)
    assert len(notes) == 1 and notes[0].startswith("llmrl: CPU defaults for --dataset: group_size 4, eval_n 16, steps 20, ")


def test_no_cpu_shapes_with_a_config_file_a_gpu_another_task_or_outside_train(tmp_path):
    data = gsm8k_rows(tmp_path / "rows.jsonl", 30)
    (tmp_path / "c.yaml").write_text(f"dataset: {data}\ndevice: cpu\n")
    notes = []
    assert load_config(tmp_path / "c.yaml", notes=notes).batch_size == 8 and notes == []  # the file's shapes
    assert load_config(None, {"dataset": data, "device": "cpu"}).batch_size == 8  # llmrl eval: not asked
    given = {"task": "dataset", "dataset": data}
    assert cpu_dataset_shapes(given, has_cuda=lambda: True) == {}  # device auto on a GPU machine
    assert cpu_dataset_shapes(given | {"device": "cuda:1"}, has_cuda=lambda: 1 / 0) == {}  # not even asked
    assert cpu_dataset_shapes(given, has_cuda=lambda: False) == CPU_DATASET_SHAPES
    assert cpu_dataset_shapes({"task": "format_copy", "device": "cpu"}, has_cuda=lambda: False) == {}


def test_the_holdout_takes_at_most_a_fifth_of_the_rows_and_leaves_a_batch():
    assert holdout_size(30, 64, 8) == 6  # 30 // 5 (the run: 64 asked, 29 held out before)
    assert holdout_size(30, 16, 4) == 6 and holdout_size(30, 3, 4) == 3  # fewer asked: as asked
    assert holdout_size(300, 64, 4) == 60 and holdout_size(1000, 64, 4) == 64
    assert holdout_size(10, 16, 9) == 1  # 10 // 5 = 2 would leave 8 rows for a batch of 9
    assert holdout_size(4, 16, 4) == 1 and holdout_size(2, 16, 0) == 1  # at least one eval row


def test_thirty_rows_hold_out_six_said_in_one_line(tmp_path, capsys):
    data = gsm8k_rows(tmp_path / "rows.jsonl", 30)
    task = DatasetTask(seed=0, source=data, grader="number", eval_holdout=16, batch_size=4)
    assert (len(task.train_rows), len(task.eval_rows)) == (24, 6)
    assert task.data_report["eval"]["rows"] == 6 and task.data_report["train"]["kept"] == 24
    assert capsys.readouterr().err.splitlines() == [
        f"llmrl: dataset '{data}': 24 rows train, 6 held out for eval (eval_holdout 16 cut to 20% of the 30 "
        "rows); --eval_split SPLIT evaluates on another split"]
    check_train_rows(task, 4)  # 24 rows fill a batch of 4
    task = DatasetTask(seed=0, source=data, grader="number", eval_holdout=5, batch_size=4)
    assert (len(task.train_rows), len(task.eval_rows)) == (25, 5) and capsys.readouterr().err == ""


def test_fewer_training_rows_than_a_batch_stop_in_one_line(tmp_path):
    data = gsm8k_rows(tmp_path / "rows.jsonl", 4)
    task = DatasetTask(seed=0, source=data, grader="number", eval_holdout=16, batch_size=4)
    assert (len(task.train_rows), len(task.eval_rows)) == (3, 1)
    with pytest.raises(ConfigError) as e:
        check_train_rows(task, 4)
    assert str(e.value) == (f"dataset '{data}': 3 usable training rows (1 more held out for eval), fewer than one "
                            "step's batch_size 4 prompts; give --batch_size 3, --eval_split SPLIT or more rows")
    task = DatasetTask(seed=0, source=gsm8k_rows(tmp_path / "r10.jsonl", 10), grader="number", eval_holdout=2)
    with pytest.raises(ConfigError, match=r"8 usable training rows \(2 more held out for eval\), fewer than one "
                                          r"step's batch_size 9 prompts; give --batch_size 8, --eval_holdout 1, "):
        check_train_rows(task, 9)  # built without batch_size (as eval does): 2 held out; 1 would leave 9


def test_the_cli_stops_with_one_line_and_exit_2_before_loading_the_model(tmp_path, capsys, tiny_model_dir):
    from llmrl.cli import main

    data = gsm8k_rows(tmp_path / "rows.jsonl", 4)
    code = main(["train", "--model", tiny_model_dir, "--dataset", data, "--device", "cpu", "--grader", "number",
                 "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err[-1] == (f"llmrl: error: dataset '{data}': 3 usable training rows (1 more held out for "
                                     "eval), fewer than one step's batch_size 4 prompts; give --batch_size 3, "
                                     "--eval_split SPLIT or more rows")
    assert len(err) == 2 and err[0].startswith(f"llmrl: dataset '{data}': 3 rows train, 1 held out")
    assert not (tmp_path / "run").exists()  # (the CPU shapes' line comes once the data fills a batch)


def test_the_math_grader_reading_no_box_names_the_number_grader():
    pairs = [("The answer is 9.", "9"), ("I think it is 12 apples in total", "9"), ("so \\boxed{9}", "9")]
    assert unread_hint("math", pairs) == (
        "the math grader found no answer (a \\boxed{}) in 2 of 3 completions, which score 0: e.g. 'The answer is 9.' "
        "(gold '9'): --grader number reads '9' there, the gold")
    # the one another grader reads as the gold is shown, a long one by its end
    long = "Let me think. " * 20 + "So she has 18 apples left."
    hint = unread_hint("math", [("No idea.", "18"), (long, "18")])
    assert hint.endswith("e.g. '…" + ("Let me think. " * 20 + "So she has 18 apples left.")[-99:].strip()
                         + "' (gold '18'): --grader number reads '18' there, the gold")
    assert "found no answer (a number) in 2 of 2" in unread_hint("number", [("I do not know", "9")] * 2)
    assert unread_hint("number", [("I do not know", "9")] * 2).endswith("--grader exact reads 'I do not know' there")
    assert unread_hint("math", [("", "9")] * 2).endswith("no built-in grader reads an answer there: score such "
                                                          "replies with --reward_funcs file.py:f")


def test_no_hint_when_most_completions_are_readable():
    assert unread_hint("math", [("\\boxed{8}", "9"), ("The answer is 9.", "9")]) is None  # half: not most
    assert unread_hint("number", [("The answer is 9.", "9"), ("nine", "9"), ("10", "9")]) is None
    assert unread_hint("math", []) is None


def test_the_task_hints_for_its_grader_and_not_for_reward_functions(tmp_path):
    data = gsm8k_rows(tmp_path / "rows.jsonl", 10)
    task = DatasetTask(seed=0, source=data, grader="math", eval_holdout=1)
    assert task.unread_hint(["9", "9"], ["The answer is 9.", "9 it is"]).startswith("the math grader found no answer")
    (tmp_path / "r.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    task = DatasetTask(seed=0, source=data, reward_funcs=[f"{tmp_path}/r.py:f"], eval_holdout=1)
    assert task.unread_hint(["9", "9"], ["The answer is 9.", "9 it is"]) is None


def test_the_grader_warning_is_given_once_per_run_beside_the_health_warnings():
    cfg, health = TrainConfig(), Health()
    metrics = {"reward/mean": 0.0, "reward/min": 0.0, "reward/max": 1.0}
    assert health.check(cfg, metrics, "the math grader found no answer") == ["the math grader found no answer"]
    assert health.check(cfg, metrics, "the math grader found no answer") == []
    assert health.check(cfg, metrics) == [] and Health(**vars(health)).once("unread", "again") is None  # resumed
    health = Health()
    assert health.once("unread", None) is None and health.once("unread", "eval's") == "eval's"
    assert health.check(cfg, metrics, "a step's") == []  # the eval gave it already


@pytest.mark.slow
def test_a_cpu_dataset_run_says_its_shapes_its_holdout_and_its_grader_once(tmp_path, tiny_model_dir):
    from helpers import read_jsonl, run_cli, tiny_args

    data = gsm8k_rows(tmp_path / "rows.jsonl", 30)
    out = tmp_path / "run"
    args = tiny_args(tiny_model_dir, out, "grpo", steps=2, task="dataset", max_prompt_tokens=128, device="cpu")
    p = run_cli(*args, "--dataset", data, "--grader", "math")  # every shape given but eval_holdout
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("llmrl:")]
    assert f"llmrl: dataset '{data}': 24 rows train, 6 held out for eval" in "\n".join(lines)
    assert [line for line in lines if "CPU defaults" in line] == [
        "llmrl: CPU defaults for --dataset: eval_holdout 16 (configs/quickstart.yaml's 4 prompts × 4 completions "
        "with room for a worked answer, examples/gsm8k/cpu.yaml's schedule); give --config or these flags to change"]
    hints = [line for line in lines if "grader found no answer" in line]  # the random tiny model writes no \boxed{}
    assert len(hints) == 1 and hints[0].startswith("llmrl: warning: eval at step 0: the math grader found no answer "
                                                   "(a \\boxed{}) in 2 of 2 completions, which score 0: e.g. ")
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "warnings" in r and "grader found no answer" in r["warnings"][0]] == [0]
    assert json.loads((out / "data_report.json").read_text())["eval"]["rows"] == 6
    # without an eval before step 1 the first step says it (and the final eval does not again)
    p = run_cli(*tiny_args(tiny_model_dir, tmp_path / "run2", "grpo", steps=1, task="dataset", max_prompt_tokens=128,
                           device="cpu", eval_interval=0), "--dataset", data, "--grader", "math")
    assert p.returncode == 0, p.stderr[-3000:]
    hints = [line for line in p.stderr.splitlines() if "grader found no answer" in line]
    assert len(hints) == 1 and hints[0].startswith("llmrl: warning: step 1: the math grader found no answer (a "
                                                   "\\boxed{}) in 6 of 6 completions")
