"""What a model directory, a dataset file or a chat template can do to llmrl: never run code, never hang, and a
bad one is one line. A model's own code (`auto_map`) is never run, even with `y` piped to transformers'
"run custom code? [y/N]" prompt; pickled weights are refused before anything is unpickled; dataset files of
mixed types, or empty, load as text or are one line; a chat template that loops for ever is refused at start;
math gold answers are read by math-verify when their row is drawn, not all at start."""

import ast
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TESTS, run_cli, tiny_args
from llmrl.errors import ModelError
from llmrl.models.loading import load_base_model, resolve_model_path

SRC = TESTS.parent / "src" / "llmrl"


def one_line(p: subprocess.CompletedProcess) -> str:
    """stderr, which must be exactly one line."""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- a model's own code


def custom_code_model(d: Path, marker: Path, model_type: str = "llmrl_custom_code") -> Path:
    """A model directory whose config and tokenizer config name code of their own (`auto_map`) in a .py file that
    writes `marker` when it is imported."""
    d.mkdir(parents=True, exist_ok=True)
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel",
                "AutoTokenizer": ["custom.CustomTokenizer", None]}
    config = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    (d / "config.json").write_text(json.dumps({**config, "model_type": model_type, "auto_map": auto_map}))
    tok_config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
    if model_type == "llmrl_custom_code":
        tok_config["tokenizer_class"] = "CustomTokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_config, "auto_map": {"AutoTokenizer": auto_map["AutoTokenizer"]}}))
    (d / "custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'llmrl_custom_code'\n")
    return d


def test_a_model_s_own_code_never_runs_even_with_yes_on_stdin(tmp_path, tiny_model_dir):
    marker = tmp_path / "MARKER"
    model = custom_code_model(tmp_path / "custom", marker)
    # transformers itself, asked without trust_remote_code, reads `y` from stdin and runs the file: the danger is real
    probe = subprocess.run([sys.executable, "-c", f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(model)!r})"],
                           input="y\n", capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and marker.read_text() == "ran", probe.stderr[-2000:]
    marker.unlink()
    # llmrl's train, with the same `y` on stdin: one line, nothing run
    p = subprocess.run([sys.executable, "-m", "llmrl", *tiny_args(str(model), tmp_path / "run", "grpo", steps=1)],
                       input="y\n", capture_output=True, text=True, timeout=600, cwd=TESTS,
                       env={**__import__("os").environ, "PYTHONPATH": str(TESTS)})
    line = one_line(p)
    assert p.returncode == 2 and "code of its own" in line and "custom.py" in line and "trust_remote_code" in line and str(model) in line
    assert not marker.exists() and not (tmp_path / "run").exists()
    # the loaders themselves, in this process (stdin is not read: pytest's is closed)
    with pytest.raises(ModelError, match="code of its own") as e:
        load_base_model(str(model), torch.device("cpu"), torch.float32)
    assert "\n" not in str(e.value) and not marker.exists()


def test_a_supported_architecture_with_an_auto_map_loads_without_its_code(tmp_path, tiny_model_dir):
    """A Llama whose config also names code of its own loads as transformers' own Llama; the .py never runs."""
    marker = tmp_path / "MARKER"
    model = tmp_path / "llama"
    shutil.copytree(tiny_model_dir, model)
    custom_code_model(model, marker, model_type="llama")
    loaded, tokenizer = load_base_model(str(model), torch.device("cpu"), torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM" and len(tokenizer) > 0 and not marker.exists()
    reference, _ = load_base_model(tiny_model_dir, torch.device("cpu"), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values()))


LOADERS = {"from_pretrained", "from_config", "LLM"}  # transformers/peft loaders (from_config: a config's auto_map), vLLM


def test_every_loader_call_in_the_source_says_trust_remote_code_false():
    """In addition to the behavioural tests above: each from_pretrained / from_config (and vLLM LLM) call in src/ passes
    trust_remote_code=False, and nothing calls transformers' pipeline()."""
    calls, missing = 0, []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            assert name != "pipeline", f"{path}:{node.lineno}: transformers' pipeline()"
            if name in LOADERS:
                calls += 1
                if not any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                           for k in node.keywords):
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert calls >= 8 and not missing, missing


# ----------------------------------------------------------------------------- pickled weights


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def pickled_model(d: Path, tiny_model_dir: str, marker: Path, name: str = "pytorch_model.bin") -> Path:
    """The tiny model's config and tokenizer, its weights replaced by a pickle that writes `marker` when unpickled."""
    shutil.copytree(tiny_model_dir, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / name).write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload(marker)}))
    return d


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickled_weights_are_refused_in_one_line_and_never_unpickled(tmp_path, tiny_model_dir, name):
    marker = tmp_path / "MARKER"
    model = pickled_model(tmp_path / "m", tiny_model_dir, marker, name)
    with pytest.raises(ModelError) as e:
        load_base_model(str(model), torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert "\n" not in message and str(model / name) in message and "safetensors" in message and "convert" in message
    with pytest.raises(ModelError):
        resolve_model_path(str(model))  # what vLLM and every other loader gets its path from
    p = run_cli(*tiny_args(str(model), tmp_path / "run", "grpo", steps=1))
    line = one_line(p)
    assert p.returncode == 2 and name in line and "safetensors" in line
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_hub_model_without_safetensors_weights_is_one_line_saying_so():
    """Hub ids load with use_safetensors=True: transformers never fetches a pickle, and says so in its words."""
    from llmrl.models.loading import load_error

    line = load_error("org/old", OSError("Error no file named model.safetensors found in directory /cache/org/old."))
    assert line.startswith("model 'org/old' could not be loaded: Error no file named model.safetensors") and "convert" in line


def test_pickles_beside_safetensors_weights_are_not_read(tmp_path, tiny_model_dir):
    """A trainer's `training_args.bin` (a pickle) beside model.safetensors: the model loads, the pickle is never read."""
    marker = tmp_path / "MARKER"
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "training_args.bin").write_bytes(pickle.dumps(Payload(marker)))
    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Payload(marker)}))
    loaded, _ = load_base_model(str(model), torch.device("cpu"), torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM" and not marker.exists()


# ----------------------------------------------------------------------------- chat templates

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"


def test_a_chat_template_that_loops_for_ever_is_refused_in_one_line(tmp_path, monkeypatch, tiny_model_dir):
    import llmrl.chat_templates as ct
    from llmrl.errors import ConfigError
    from llmrl.models.loading import load_tokenizer

    monkeypatch.setattr(ct, "RENDER_LIMIT", 3.0)
    tokenizer = load_tokenizer(tiny_model_dir)
    own = tokenizer.chat_template
    loops = tmp_path / "loops.jinja"
    loops.write_text(LOOPS)
    with pytest.raises(ConfigError) as e:
        ct.use_chat_template(tokenizer, str(loops))
    assert "\n" not in str(e.value) and str(loops) in str(e.value) and "over 3 s" in str(e.value)
    assert tokenizer.chat_template == own  # not given to the tokenizer
    # a template file that renders in time is used; one that raises on a sample is left to say so where it is used
    fine = tmp_path / "chatml.jinja"
    fine.write_text(ct.CHATML_TOOLS)
    ct.use_chat_template(tokenizer, str(fine))
    assert tokenizer.chat_template == ct.CHATML_TOOLS
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi.<|im_end|>\n")
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                      "{{ messages[0]['content'] }}")
    ct.use_chat_template(tokenizer, str(strict))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], tokenize=False) == "Hi."


@pytest.mark.slow
def test_train_with_a_looping_chat_template_stops_in_one_line(tmp_path, tiny_model_dir):
    loops = tmp_path / "loops.jinja"
    loops.write_text(LOOPS)
    p = run_cli(*tiny_args(tiny_model_dir, tmp_path / "run", "grpo", steps=1, chat_template=str(loops)))
    lines = [line for line in p.stderr.splitlines() if "Loading weights" not in line and line.strip()]  # the model loads first
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines[0].startswith("llmrl: error: chat_template=") and str(loops) in lines[0] and "took over 10 s" in lines[0]


# ----------------------------------------------------------------------------- gold answers read when drawn


class CountingPool:
    """A grading pool that counts the gold answers it is asked to read; the gold `bad` cannot be read."""

    def __init__(self, bad: str = "}{"):
        self.parsed: list[str] = []
        self.bad = bad

    def map(self, name, jobs):
        assert name == "parses"
        self.parsed += [g for (g,) in jobs]
        return [("ok", g != self.bad) for (g,) in jobs]


@pytest.fixture
def counting_pool(monkeypatch):
    from llmrl import grading

    pool = CountingPool()
    monkeypatch.setattr(grading, "get_pool", lambda workers=None, time_limit=None: pool)
    monkeypatch.setattr(grading, "_GOLD_READABLE", {})
    return pool


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_ten_thousand_math_golds_are_not_read_at_start_only_when_drawn(tmp_path, counting_pool):
    """Before: DatasetTask read all 10^4 golds with math-verify at start (38 s); now none, and each drawn row's once."""
    import random

    from llmrl.tasks.dataset import DatasetTask

    rows = [{"question": f"Q{i}", "answer": f"\\boxed{{\\frac{{{i}}}{{7}}}}"} for i in range(10_000)]
    task = DatasetTask(seed=3, source=write_rows(tmp_path / "d.jsonl", rows), grader="math", eval_holdout=64)
    assert counting_pool.parsed == []
    assert len(task.train_rows) == 10_000 - 64 and len(task.eval_rows) == 64
    rng = random.Random()
    rng.setstate(task.rng.getstate())
    expected = [task.train_rows[rng.randrange(len(task.train_rows))]["question"] for _ in range(8)]
    drawn = task.sample_train_batch(8)
    assert [ex.messages[-1]["content"] for ex in drawn] == expected  # the very rows the start-up check gave
    assert len(counting_pool.parsed) == len(set(expected)) and set(counting_pool.parsed) == {
        r["_gold"] for r in task.train_rows if r["question"] in expected}
    evals = task.eval_examples(16)
    assert [ex.messages[-1]["content"] for ex in evals] == [r["question"] for r in task.eval_rows[:16]]
    assert len(counting_pool.parsed) <= 8 + 16
    task.eval_examples(16)
    assert len(counting_pool.parsed) <= 8 + 16  # each gold is read once per process
    assert task.data_report["train"]["math_verify_reads_golds"] == "when drawn"


def test_rows_whose_gold_cannot_be_read_are_never_drawn_nor_evaluated(tmp_path, counting_pool):
    from llmrl.errors import DataError
    from llmrl.tasks.dataset import DatasetTask
    from llmrl.tasks.math_hard import MathHardTask

    rows = [{"question": f"Q{i}", "answer": "}{" if i % 2 else f"\\sqrt{{{i}}}"} for i in range(40)]
    task = DatasetTask(seed=0, source=write_rows(tmp_path / "d.jsonl", rows), grader="math", eval_holdout=10)
    drawn = task.sample_train_batch(50) + task.eval_examples(10)
    assert drawn and all(ex.answer != "}{" for ex in drawn) and len(counting_pool.parsed) <= 40
    assert len(task.eval_examples(10)) == sum(r["_gold"] != "}{" for r in task.eval_rows)
    bad = DatasetTask(seed=0, source=write_rows(tmp_path / "bad.jsonl", [{"question": "Q", "answer": "}{"}] * 3),
                      grader="math", eval_holdout=1)
    with pytest.raises(DataError, match="math-verify can read none of the 2 gold answers"):
        bad.sample_train_batch(4)
    # math_hard's verify reward: the same, its numeric seed reward reads nothing
    counting_pool.bad = "\\frac{0}{0}"  # (a fake verdict: no boxed answer can hold `}{`)
    math = [{"problem": f"P{i}", "solution": f"\\boxed{{{counting_pool.bad if i % 3 == 0 else f'x^{i}'}}}", "level": 5,
             "split": split} for split in ("train", "test") for i in range(30)]
    counting_pool.parsed.clear()
    hard = MathHardTask(data=write_rows(tmp_path / "m.jsonl", math), reward="verify")
    assert counting_pool.parsed == [] and len(hard.train_rows) == 30
    assert all(ex.answer != counting_pool.bad for ex in hard.sample_train_batch(20) + hard.eval_examples(30))
    assert len(hard.eval_examples(30)) == 20


def test_golds_read_without_math_verify_agree_with_it():
    """Plain numbers and text answers are decided in the trainer (no pool); math-verify says the same of them."""
    from llmrl import grading

    cases = ["0", "-12.25", "007", "1,000", "10,\\!000", "$5$", "5\\%", "Monday", "\\text{even}", "(C)", "x = 3", "$", " "]
    here = {g: grading.gold_readable_here(g) for g in cases}
    assert [g for g, v in here.items() if v is None] == [] and here["$"] is False and here[" "] is False
    assert all(grading.parses(g) == v for g, v in here.items())
    assert grading.gold_readable_here("\\frac{1}{2}") is None and grading.gold_readable_here("}{") is None


def test_real_pool_drops_an_unreadable_gold_when_drawn(tmp_path):
    from llmrl.tasks.dataset import DatasetTask

    rows = [{"question": "Q1", "answer": "\\boxed{\\frac{1}{2}}"}, {"question": "Q2", "answer": "}{"},
            {"question": "Q3", "answer": "#### 72"}, {"question": "Q4", "answer": "\\sqrt{2}"}, {"question": "Q5", "answer": "}{"}]
    task = DatasetTask(seed=0, source=write_rows(tmp_path / "d.jsonl", rows), grader="math", eval_holdout=1)
    readable = {r["_gold"] for r in task.train_rows} - {"}{"}
    assert {ex.answer for ex in task.sample_train_batch(40)} == readable and len(readable) >= 2


# ----------------------------------------------------------------------------- dataset files


def test_a_json_column_of_mixed_types_loads_as_the_text_written(tmp_path):
    """datasets >= 5 read such a column as JSON and decoded each text again ("007" came back 7, "true" True, "1e3"
    1000.0, "[1]" a list); < 5 refused the file with an opaque error. Now mixed scalars are text, as written."""
    from llmrl.tasks.dataset import DatasetTask, load_rows

    answers = ["007", 7, "true", "1e3", "nine", True, 2.5, None, "[1]"]
    rows = [{"question": f"Q{i}", "answer": a, "level": i} for i, a in enumerate(answers)]
    got = load_rows(write_rows(tmp_path / "mixed.jsonl", rows), None, "train")
    assert [r["answer"] for r in got] == ["007", "7", "true", "1e3", "nine", "true", "2.5", None, "[1]"]
    assert [r["level"] for r in got] == list(range(len(answers)))  # a column of one type is as datasets reads it
    (tmp_path / "mixed.json").write_text(json.dumps(rows))
    assert load_rows(str(tmp_path / "mixed.json"), None, "train") == got
    task = DatasetTask(seed=0, source=str(tmp_path / "mixed.jsonl"), grader="exact", eval_holdout=1)
    golds = sorted(r["_gold"] for r in task.train_rows + task.eval_rows)
    assert golds == sorted(["007", "7", "true", "1e3", "nine", "true", "2.5", "[1]"])
    assert task.data_report["train"]["dropped"] == {"no gold answer": 1}


def test_a_csv_column_typed_by_its_first_rows_then_text_loads_as_text(tmp_path):
    """datasets reads a CSV 10,000 rows at a time: a column of numbers that turns to text later failed
    (DatasetGenerationError: An error occurred while generating the dataset)."""
    from llmrl.tasks.dataset import load_rows

    path = tmp_path / "late.csv"
    path.write_text("question,answer,n\n" + "".join(f"q{i},{i},{i}\n" for i in range(10_050)) + "last,nine,1.5\n")
    rows = load_rows(str(path), None, "train")
    assert len(rows) == 10_051 and rows[0] == {"question": "q0", "answer": "0", "n": 0.0}
    assert rows[-1] == {"question": "last", "answer": "nine", "n": 1.5}


@pytest.mark.parametrize("name, content, problem", [
    ("empty.jsonl", b"", "the file is empty (0 bytes)"),
    ("blank.jsonl", b"  \n\n \t\n", "the file holds nothing but whitespace"),
    ("empty.csv", b"", "the file is empty (0 bytes)"),
    ("blank.json", b"\n", "the file holds nothing but whitespace"),
    ("empty.parquet", b"", "the file is empty (0 bytes)"),
    ("list.jsonl", b'{"question": "a", "answer": 9}\n{"question": "b", "answer": [1, 2]}\n',
     "column 'answer' mixes a number in row 1, a list in row 2"),
    ("object.jsonl", b'{"question": "a", "answer": {"x": 1}}\n{"question": "b", "answer": "nine"}\n',
     "column 'answer' mixes an object in row 1, text in row 2"),
    ("broken.jsonl", b'{"question": "a", "answer": 9}\n{"question": "b", "answer": "nine"}\n{"question": \n',
     "line 3 is not JSON"),
])
def test_an_empty_or_unreadable_dataset_file_is_one_line_naming_it(tmp_path, tiny_model_dir, name, content, problem):
    from llmrl.errors import DataError
    from llmrl.tasks.dataset import load_rows

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        load_rows(str(path), None, "train")
    assert str(e.value).startswith(f"dataset '{path}': {problem}") and "\n" not in str(e.value)
    if name in ("empty.jsonl", "list.jsonl"):  # the CLI: one line, nothing left behind
        p = run_cli(*tiny_args(tiny_model_dir, tmp_path / "run", "grpo", steps=1, task="dataset", dataset=str(path)))
        assert p.returncode == 2 and one_line(p).startswith(f"llmrl: error: dataset '{path}': {problem}")
        assert not (tmp_path / "run").exists()
