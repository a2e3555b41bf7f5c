"""Train on a dataset of questions and answers: a local JSONL, Parquet or CSV file, a directory of them, or a
hub id (with --dataset_config / --dataset_split), read through Hugging Face `datasets`.

    llmrl train --dataset gsm8k_train.jsonl --grader math            (task "dataset" is implied)
    llmrl train --dataset openai/gsm8k --dataset_config main --eval_split test
    llmrl train --dataset rows.jsonl --reward_funcs rewards.py:correct,rewards.py:short --reward_weights 1,0.2

A row's prompt is its `prompt_field` (default: the first of prompt, question, problem, input, query): a text
becomes the user message, after `system_prompt`; a list of chat messages (TRL's conversational format) is
used as it is. Its gold answer is read from `answer_field` (default: answer, solution, gold, target):
the text after GSM8K's `#### `, else the last `\\boxed{…}` (MATH), else the whole text. A row whose gold the
grader cannot read is dropped and counted in the data report.

Graders (the reward, and eval/correct):
- math: math-verify in the bounded grading pool (grading.py) on the completion's last `\\boxed{}`:
  +1.0 when equivalent to the gold, +0.1 for giving a boxed answer at all (as math_hard's verify reward);
- number: the completion's last boxed number, else its last number, equal to the gold number (relative
  1e-6): +1.0;
- exact: the completion's last boxed text, else its last non-empty line, equal to the gold after
  collapsing whitespace: +1.0.

With `reward_funcs` (TRL's signature: `f(prompts, completions, **columns) -> list[float | None]`, several,
each weighted by `reward_weights`, default 1), the functions score instead of the grader: each is called
once per batch with the prompts and completions as TRL passes them (text, or message lists when the prompt
field holds messages) and every other column as a keyword list. Each function's values are logged as
reward/<its name> (unweighted), the total is their weighted sum; a None is "unscored": it adds nothing to
the total and is counted in reward/unscored. Each call is bounded by user_code_timeout (a module-level function
runs in a worker process, killed at the limit; tasks/workers.py: UserCalls): one that overruns scores its
batch's completions 0, each counted in reward/errors (it is not asked again one completion at a time, as after a
raise). A column named `prompts` or `completions` would clash with
those keywords: it is refused at load. From Python a function may be given as itself (config.py code_value);
llmrl.rewards holds common ones. Each is tried at start on the first training row (check_functions): a signature
that cannot take those keywords, a return that is not a list of one number or None per completion, or a raise
stops the run in one line naming the function.

Eval: `eval_split` when given, else `eval_holdout` rows held out of the training split by the run's seed
(the data report says which): at most HOLDOUT_PERCENT (20%) of the rows, leaving one batch to train on where it can,
with a warning line when that cuts eval_holdout; a run with fewer training rows than one batch stops in one line
(check_train_rows). When the grader finds no answer in most completions, `unread_hint` says so once per run (the
run's health warnings), showing one such completion and the built-in graders that read it.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

from llmrl import grading
from llmrl.errors import ConfigError, DataError
from llmrl.tasks import seed_parsing
from llmrl.tasks.base import Example, Judgement, Reward, SeededSampling, mean_of
from llmrl.tasks.workers import CallTimeout, check_stuck, tried_at_start, user_calls

GRADERS = ("math", "number", "exact")
PROMPT_FIELDS = ("prompt", "question", "problem", "input", "query")
ANSWER_FIELDS = ("answer", "solution", "gold", "target")
SYSTEM_PROMPTS = {
    "math": "Solve the problem step by step. Put the final answer in \\boxed{}.",
    "number": "Solve the problem step by step. Put the final answer, a number, in \\boxed{}.",
    "exact": "Answer the question. Put the final answer in \\boxed{}.",
}
GSM8K_MARK = re.compile(r"####\s*(.*?)\s*$", re.DOTALL)
FUNCTION_KEYWORDS = ("prompts", "completions")  # what a TRL reward function gets beside the columns
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def gold_answer(value: Any) -> str | None:
    """The gold answer in a row's answer field: the text after GSM8K's `#### `, else the last `\\boxed{…}`,
    else the whole text, stripped; None when that is empty (or the value is no text or number)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    text = str(value)
    if (m := GSM8K_MARK.search(text)) is not None:
        text = m.group(1)
    elif (boxed := grading.last_boxed(text)) is not None:
        text = boxed
    return text.strip() or None


def gold_number(gold: str) -> float | None:
    """A gold answer as a number ("1,234" → 1234.0, "3/4" → 0.75), or None."""
    return seed_parsing.parse_number(gold.replace(",", ""))


def gold_of(row: dict[str, Any]) -> str:
    """A usable row's gold answer (read by gold_answer when the row was loaded)."""
    return row["_gold"]


def completion_number(completion: str) -> float | None:
    """The number a completion answers with: its last boxed number, else the last number in it."""
    boxed = seed_parsing.boxed_number(completion)
    return boxed if boxed is not None else seed_parsing.last_number(completion)


def completion_text(completion: str) -> str | None:
    """The text a completion answers with: its last boxed content, else its last non-empty line."""
    boxed = grading.extract_answer(completion)
    if boxed is not None:
        return boxed
    lines = [line.strip() for line in grading.strip_think(completion).splitlines() if line.strip()]
    return lines[-1] if lines else None


def same_words(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


GRADER_NEEDS = {"math": "a \\boxed{}", "number": "a number", "exact": "a non-empty line"}  # what each one reads


def grader_reading(grader: str, completion: str, gold: str) -> tuple[str, bool] | None:
    """(the answer `grader` reads in `completion`, as text; whether it is the gold), or None when it finds none.
    Whether the math grader's boxed answer is the gold is a plain comparison here (math-verify decides in
    training): the same words, or the same number."""
    if grader == "number":
        value, want = completion_number(completion), gold_number(gold)
        if value is None:
            return None
        return f"{value:g}", want is not None and math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-9)
    answer = grading.extract_answer(completion) if grader == "math" else completion_text(completion)
    if answer is None:
        return None
    if grader == "exact":
        return answer, same_words(answer, gold)
    value, want = gold_number(answer), gold_number(gold)
    return answer, same_words(answer, gold) or value is not None and want is not None and math.isclose(value, want)


def shortened(text: str, most: int = 100) -> str:
    """`text` on one line, its last `most` characters at most (a reply's answer is at its end)."""
    text = " ".join(text.split())
    return text if len(text) <= most else "…" + text[-(most - 1):]


def unread_hint(grader: str, pairs: list[tuple[str, str]]) -> str | None:
    """When `grader` finds no answer in most (more than half) of the (completion, gold) `pairs`: one line showing one
    such completion, shortened, and naming the built-in graders that read an answer there (those that read the gold,
    when any do); else None. The completion shown is one that another grader reads as the gold, else one it reads
    at all, else the first unread one."""
    unread = [(c, gold) for c, gold in pairs if grader_reading(grader, c, gold) is None]
    if not pairs or 2 * len(unread) <= len(pairs):
        return None

    def readers(c: str, gold: str) -> list[tuple[str, str, bool]]:
        return [(g, *r) for g in GRADERS if g != grader and (r := grader_reading(g, c, gold)) is not None]

    def rank(pair: tuple[str, str]) -> int:
        found = readers(*pair)
        return 2 if any(right for _, _, right in found) else 1 if found else 0

    completion, gold = max(unread, key=rank)  # the first of the best
    found = readers(completion, gold)
    right = [(g, answer) for g, answer, ok in found if ok]
    if right:
        named = "; ".join(f"--grader {g} reads {answer!r} there, the gold" for g, answer in right)
    elif found:
        named = "; ".join(f"--grader {g} reads {answer!r} there" for g, answer, _ in found)
    else:
        named = "no built-in grader reads an answer there: score such replies with --reward_funcs file.py:f"
    return (f"the {grader} grader found no answer ({GRADER_NEEDS[grader]}) in {len(unread)} of {len(pairs)} "
            f"completions, which score 0: e.g. {shortened(completion)!r} (gold {gold!r}): {named}")


def load_rows(source: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """The rows of one split: from a local file (every row; JSONL, JSON, Parquet, CSV), a local directory
    (its files as `datasets` maps them to splits) or a hub dataset. One DataError line when it cannot. A local file
    must not be empty; a JSON/CSV column of mixed types is read as written (read_text_rows: mixed scalars as text)."""
    from datasets import load_dataset
    from datasets.utils import logging as datasets_bars

    path = Path(source)
    quiet = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "fsspec")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)  # the hub client's retry lines would precede the one-line error
    bars = datasets_bars.is_progress_bar_enabled()
    datasets_bars.disable_progress_bar()  # "Generating train split: 30 examples" for a 30-line file is noise
    try:
        if path.is_file():
            builder = LOCAL_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"dataset '{source}': unknown file type {path.suffix!r} (use "
                                f"{', '.join(LOCAL_BUILDERS)})")
            check_not_empty(path, source)
            try:
                rows = load_dataset(builder, data_files=str(path), split="train")
            except Exception:  # noqa: BLE001 - e.g. mixed types (datasets < 5), a CSV column typed by its first block
                if builder == "parquet":
                    raise
                return read_text_rows(path, builder, source)  # what is wrong, or the rows
            if any("Json(" in repr(feature) for feature in rows.features.values()):
                # datasets >= 5 holds a column of mixed types as JSON and decodes each value again on the way out:
                # the text "007" came back as 7, "true" as True, "[1]" as a list
                return read_text_rows(path, builder, source)
        elif path.suffix.lower() in LOCAL_BUILDERS or source.startswith((".", "/", "~")):
            raise DataError(f"dataset '{source}': no such file (a hub dataset is named owner/name; "
                            f"the working directory is {Path.cwd()})")
        else:
            rows = load_dataset(source, config, split=split)
        return [dict(r) for r in rows]
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing split, a bad file, offline: one line naming it
        first = (str(e).strip().splitlines() or [""])[0][:200]
        where = "file" if path.is_file() else "directory" if path.is_dir() else "hub dataset"
        raise DataError(f"dataset '{source}' ({where}, split {split!r}): could not load it: {type(e).__name__}: "
                        f"{first}") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        if bars:
            datasets_bars.enable_progress_bar()


def check_not_empty(path: Path, source: str) -> None:
    """One DataError line for a data file of 0 bytes or (a text format) nothing but whitespace."""
    if path.stat().st_size == 0:
        raise DataError(f"dataset '{source}': the file is empty (0 bytes)")
    if path.suffix.lower() == ".parquet":
        return
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return
    raise DataError(f"dataset '{source}': the file holds nothing but whitespace")


def read_text_rows(path: Path, builder: str, source: str) -> list[dict[str, Any]]:
    """The rows of a JSON/JSONL (`builder` json) or CSV file that `datasets` cannot type, read as written: a column of
    mixed scalar types (9 in one row, "nine" in another) becomes text (9 -> "9", true -> "true"); one whose values are
    all numbers stays numbers (ints as floats beside floats, as `datasets` reads them). One DataError line for what
    cannot be read: a line that is not JSON, a row that is not an object, a column that mixes lists or objects with
    other values, a CSV row of the wrong width."""
    rows = _json_rows(path, source) if builder == "json" else _csv_rows(path, source)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    table = {c: [row.get(c) for row in rows] for c in columns}
    for c in columns:
        table[c] = _one_type(table[c], c, source)
    return [{c: table[c][i] for c in columns} for i in range(len(rows))]


def _json_rows(path: Path, source: str) -> list[dict[str, Any]]:
    import json

    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        whole = json.loads(text)
    except ValueError:  # JSON Lines
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise DataError(f"dataset '{source}': line {n} is not JSON ({e.msg})") from None
    else:
        rows = whole if isinstance(whole, list) else [whole]
        if isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values()):
            lengths = {len(v) for v in whole.values()}  # one object of columns
            if len(lengths) != 1:
                raise DataError(f"dataset '{source}': its columns have different lengths ({sorted(lengths)})")
            rows = [dict(zip(whole, values)) for values in zip(*whole.values())]
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"dataset '{source}': row {n} is {_kind(row)}, not an object of columns")
    return rows


def _csv_rows(path: Path, source: str) -> list[dict[str, Any]]:
    import csv

    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise DataError(f"dataset '{source}': no header line")
        rows = []
        for n, fields in enumerate(reader, 2):
            if not fields:
                continue
            if len(fields) != len(header):
                raise DataError(f"dataset '{source}': line {n} has {len(fields)} fields, the header {len(header)}")
            rows.append(dict(zip(header, fields)))
    table = {c: [row[c] for row in rows] for c in header}
    for c, values in table.items():  # a column of numbers is numbers (empty: None), as datasets reads a CSV
        for kind in (int, float):
            try:
                numbers = [kind(v) if v.strip() else None for v in values]
            except ValueError:
                continue
            if any(v is not None for v in numbers):
                table[c] = numbers
                break
    return [{c: table[c][i] for c in header} for i in range(len(rows))]


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _one_type(values: list[Any], column: str, source: str) -> list[Any]:
    """A column's values with one type: mixed scalars as text, ints as floats beside floats; lists or objects mixed
    with anything else: one DataError line naming the first row of each kind."""
    import json

    first: dict[str, int] = {}
    for n, v in enumerate(values, 1):
        if v is not None:
            first.setdefault(_kind(v), n)
    containers = [k for k in first if k in ("a list", "an object")]
    if containers and len(first) > 1:
        kinds = ", ".join(f"{k} in row {n}" for k, n in first.items())
        raise DataError(f"dataset '{source}': column {column!r} mixes {kinds}; give it the same kind of value in "
                        "every row")
    if len(first) <= 1 or containers:
        if first.keys() == {"a number"} and any(isinstance(v, float) for v in values):
            return [None if v is None else float(v) for v in values]
        return values
    return [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]  # mixed scalars: as text


def pick_field(rows: list[dict[str, Any]], given: str | None, candidates: tuple[str, ...], what: str,
               source: str) -> str:
    """The column holding `what`: `given` (it must exist), else the first of `candidates` present."""
    columns = list(rows[0]) if rows else []
    if given is not None:
        if rows and given not in columns:
            raise DataError(f"dataset '{source}': no column {given!r} for the {what} (columns: {', '.join(columns)})")
        return given
    found = next((c for c in candidates if c in columns), None)
    if found is None:
        raise DataError(f"dataset '{source}': no {what} column among {', '.join(columns) or 'none'}; name it with "
                        f"--{what}_field")
    return found


def called_as(name: str, fn: Any) -> str:
    """A reward function as a message shows it: `correct(completion, answer)`, or its name without a signature."""
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return name


def signature_problem(fn: Any, kwargs: dict[str, Any]) -> str | None:
    """Why `fn` cannot be called with these keywords (inspect's words), or None (it can, or has no signature to
    read: a builtin's calls say)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        return str(e)
    return None


def is_score(value: Any) -> bool:
    """A value a reward function may give a completion: None (unscored), or a real number (a bool, a NumPy or torch
    scalar too)."""
    if value is None or isinstance(value, numbers.Real):
        return True
    try:
        return isinstance(value.item(), numbers.Real)
    except Exception:  # noqa: BLE001 - no .item(), or not one element
        return False


def values_problem(values: Any, n: int) -> str | None:
    """What is wrong with a reward function's return for `n` completions (it must be a list of n numbers or None,
    one per completion), or None: `returned 0.5 (a float), not a list`, `returned 1 value for 2 completions`."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        return f"returned {repr(values)[:60]} (a {type(values).__name__}), not a list"
    if len(values) != n:
        return f"returned {len(values)} value{'s' * (len(values) != 1)} for {n} completions"
    bad = next((v for v in values if not is_score(v)), None)
    if bad is not None:
        return f"returned a list holding {repr(bad)[:60]} (a {type(bad).__name__}), not a number or None"
    return None


def load_reward_funcs(specs: list[str], weights: list[float]) -> list[tuple[str, Any, float]]:
    """(name, function, weight) of each `file.py:f` / `module:f` in `specs`, or a function given from Python
    (tasks/custom.py: python_spec's marker); the name is the function's __name__ (its logs' reward/<name>)."""
    from llmrl.tasks.custom import is_python_marker, load_object, marker_name, python_object

    if weights and len(weights) != len(specs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(specs)} reward_funcs")
    funcs = []
    for spec, w in zip(specs, weights or [1.0] * len(specs)):
        marked = is_python_marker(spec)
        fn = python_object(spec, "reward_funcs") if marked else load_object(spec)
        if not callable(fn) or inspect.isclass(fn):
            raise ConfigError(f"reward_funcs: {spec!r} is not a function")
        funcs.append((getattr(fn, "__name__", None) or (marker_name(spec) if marked else spec.rpartition(":")[2]),
                      fn, float(w)))
    names = [n for n, _, _ in funcs]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward_funcs: two functions share a name ({', '.join(names)}): their logs would mix")
    return funcs


HOLDOUT_PERCENT = 20  # the eval hold-out takes at most this share of the training split's rows


def holdout_size(rows: int, asked: int, batch: int = 0) -> int:
    """Rows held out of `rows` for eval: eval_holdout (`asked`), but at most HOLDOUT_PERCENT of the rows and leaving
    at least `batch` rows (one training step's prompts) where it can; at least 1. 30 rows, asked 64, batch 4: 6;
    300 rows: 60; 10 rows, batch 9: 1."""
    return max(1, min(asked, rows * HOLDOUT_PERCENT // 100, rows - batch))


def check_train_rows(task: Any, batch_size: int) -> None:
    """Training on a dataset (the task's rows, or an environment's `data`): one ConfigError line when its training
    rows are fewer than one step's batch_size prompts, naming the numbers and the fixes."""
    data = task if isinstance(task, DatasetTask) else getattr(task, "data", None)
    if not isinstance(data, DatasetTask) or len(data.train_rows) >= batch_size:
        return
    train, report = len(data.train_rows), data.data_report
    held = report["eval"]["rows"] if "held_out_of" in report["eval"] else 0
    fixes = [f"--batch_size {train}"]  # a DatasetTask has at least one training row
    if held > 1 and train + held - 1 >= batch_size:
        fixes.append("--eval_holdout 1")
    fixes += ["--eval_split SPLIT"] if held else []
    where = f" ({held} more held out for eval)" if held else ""
    raise ConfigError(f"dataset '{report['source']}': {train} usable training rows{where}, fewer than one step's "
                      f"batch_size {batch_size} prompts; give {', '.join(fixes)} or more rows")


class DatasetTask(SeededSampling):
    """Questions and gold answers from a dataset, scored by a grader or by TRL-signature reward functions."""

    name = "dataset"
    eval_n_default = 256

    def __init__(self, seed: int = 0, source: str | None = None, *, config: str | None = None, split: str = "train",
                 eval_split: str | None = None, eval_holdout: int = 64, prompt_field: str | None = None,
                 answer_field: str | None = None, system_prompt: str | None = None, grader: str = "math",
                 reward_funcs: list[str] | None = None, reward_weights: list[float] | None = None,
                 time_limit: float = grading.DEFAULT_TIME_LIMIT, workers: int | None = None, needs_answer: bool = True,
                 batch_size: int = 0):
        """batch_size: prompts per training step, which the eval hold-out leaves to train on where it can
        (holdout_size); check_train_rows refuses a run with fewer training rows."""
        if source is None:
            raise ConfigError("task=dataset: give the data with --dataset PATH_OR_HUB_ID")
        if grader not in GRADERS:
            raise ConfigError(f"grader={grader!r}: must be one of {', '.join(GRADERS)}")
        self.rng = random.Random(seed)
        self._last: tuple[list, list[grading.Verdict]] = ([], [])
        self.grader, self.time_limit, self.workers = grader, time_limit, workers
        self.funcs = load_reward_funcs(list(reward_funcs or []), list(reward_weights or []))
        self.system = system_prompt if system_prompt is not None else SYSTEM_PROMPTS[grader]
        train = load_rows(source, config, split)
        if not train:
            raise DataError(f"dataset '{source}' ({split}): no rows")
        self.prompt_field = pick_field(train, prompt_field, PROMPT_FIELDS, "prompt", source)
        # the grader needs gold answers; reward functions (or an environment's own reward) do not
        self.needs_answer = needs_answer and not self.funcs
        self.answer_field = (pick_field(train, answer_field, ANSWER_FIELDS, "answer", source)
                             if self.needs_answer or answer_field is not None else None)
        report: dict[str, Any] = {"source": source, "split": split, "prompt_field": self.prompt_field,
                                  "answer_field": self.answer_field,
                                  "scored_by": [n for n, _, _ in self.funcs] or f"grader {grader}"}
        self.train_rows, report["train"] = self.usable(train)
        if eval_split is not None:
            self.eval_rows, report["eval"] = self.usable(load_rows(source, config, eval_split))
            report["eval"]["split"] = eval_split
        else:  # a slice of the training split, held out by the seed
            order = list(range(len(self.train_rows)))
            random.Random(seed).shuffle(order)
            n = holdout_size(len(order), eval_holdout, batch_size)
            if n < eval_holdout and os.environ.get("RANK", "0") == "0":
                print(f"llmrl: dataset '{source}': {len(order) - n} rows train, {n} held out for eval "
                      f"(eval_holdout {eval_holdout} cut to {HOLDOUT_PERCENT}% of the {len(order)} rows); "
                      "--eval_split SPLIT evaluates on another split", file=sys.stderr, flush=True)
            held = set(order[:n])
            self.eval_rows = [r for i, r in enumerate(self.train_rows) if i in held]
            self.train_rows = [r for i, r in enumerate(self.train_rows) if i not in held]
            report["eval"] = {"held_out_of": split, "rows": len(self.eval_rows), "seed": seed}
            report["train"]["kept"] = len(self.train_rows)
        self.data_report = report
        if not self.train_rows or not self.eval_rows:
            raise DataError(f"dataset '{source}': {len(self.train_rows)} training and {len(self.eval_rows)} eval rows "
                            f"usable ({report}); each needs at least one")
        self.refuse_columns(FUNCTION_KEYWORDS, f"dataset '{source}'")
        self._overran: tuple[str, list[tuple[Example, Any]], str] | None = None  # the last reward call that overran

    def refuse_columns(self, keywords: tuple[str, ...], where: str) -> None:
        """With reward functions, one DataError line for a column named like a keyword they get beside the columns
        (prompts=, completions=; an environment_factory's environments=): every call would fail on the clash.
        Refused rather than renamed, so that a function reading that column never gets something else."""
        if not self.funcs:
            return
        columns = dict.fromkeys(k for rows in (self.train_rows, self.eval_rows) for k in (rows[0] if rows else {}))
        clash = [k for k in keywords if k in columns]
        if clash:
            raise DataError(f"{where}: a column is named {clash[0]!r}, the keyword a reward function gets its "
                            f"{clash[0]} by (TRL's signature: f(prompts, completions, **columns)); rename the column")

    def usable(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The rows with a prompt and, for a grader, a gold answer it can read: (kept, {kept, dropped: reasons})."""
        kept, dropped = [], {}
        golds = []
        for row in rows:
            prompt = row.get(self.prompt_field)
            if not (isinstance(prompt, str) and prompt.strip()) and not self.is_messages(prompt):
                dropped["no prompt"] = dropped.get("no prompt", 0) + 1
                continue
            gold = gold_answer(row.get(self.answer_field)) if self.answer_field else None
            if self.answer_field and self.needs_answer:
                reason = self.unreadable(gold)
                if reason:
                    dropped[reason] = dropped.get(reason, 0) + 1
                    continue
            kept.append(row | {"_gold": gold})
            golds.append(gold)
        if self.reads_golds and kept:  # math-verify must read the gold: here only what needs no math-verify
            ok = [grading.gold_readable_here(r["_gold"]) is not False for r in kept]  # the rest when drawn
            dropped["gold math-verify cannot read"] = sum(not x for x in ok)
            kept = [r for r, x in zip(kept, ok) if x]
        report = {"kept": len(kept), "dropped": {k: v for k, v in dropped.items() if v}}
        return kept, report | ({"math_verify_reads_golds": "when drawn"} if self.reads_golds else {})

    @property
    def reads_golds(self) -> bool:
        """Whether math-verify must read each row's gold before the row is used: the math grader's rows are drawn and
        taken for eval only where it can (grading.draw_readable, first_readable: each gold read when its row is
        first drawn, not the whole pool at start)."""
        return self.grader == "math" and self.needs_answer

    def unreadable(self, gold: str | None) -> str | None:
        """Why the grader cannot use this gold answer (None: it can)."""
        if gold is None:
            return "no gold answer"
        if self.grader == "number" and gold_number(gold) is None:
            return "gold is not a number"
        return None

    @staticmethod
    def is_messages(value: Any) -> bool:
        return (isinstance(value, list) and bool(value)
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in value))

    def example(self, row: dict[str, Any]) -> Example:
        prompt = row[self.prompt_field]
        if self.is_messages(prompt):
            messages = [dict(m) for m in prompt]
            if self.system and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system}] + messages
        else:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": prompt}]
        return Example(messages=messages, answer=row["_gold"],
                       meta={k: v for k, v in row.items() if k != "_gold"})

    def sample_train_batch(self, n: int) -> list[Example]:
        check_stuck()  # too many overrunning reward calls still running on threads: the run stops here, in one line
        if self.reads_golds:
            return [self.example(r) for r in grading.draw_readable(
                self.train_rows, n, self.rng, gold_of, what=f"dataset '{self.data_report['source']}'",
                time_limit=self.time_limit, workers=self.workers)]
        return [self.example(self.train_rows[self.rng.randrange(len(self.train_rows))]) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        check_stuck()
        if self.reads_golds:
            return [self.example(r) for r in grading.first_readable(self.eval_rows, n, gold_of, time_limit=self.time_limit,
                                                                    workers=self.workers)]
        return [self.example(r) for r in self.eval_rows[:n]]

    # ------------------------------------------------------------------ scoring

    def reward_batch(self, examples: list[Example], completions: list[str]) -> list[Reward]:
        if self.funcs:
            return self.function_rewards(examples, completions)
        if self.grader == "math":
            verdicts = self.verdicts(examples, completions)
            return [Reward(total=0.1 * (v.extracted is not None) + 1.0 * v.correct,
                           components={"boxed": 0.1 * (v.extracted is not None), "correct": 1.0 * v.correct},
                           counts={"grade_timeouts": int(v.status == "timeout")}) for v in verdicts]
        return [self.reward(ex, c) for ex, c in zip(examples, completions, strict=True)]

    def verdicts(self, examples: list[Example], completions: list[str]) -> list[grading.Verdict]:
        """math-verify's verdicts (the last batch is kept: eval asks for rewards, metrics and judgements)."""
        items = [(c, ex.answer) for ex, c in zip(examples, completions, strict=True)]
        if self._last[0] != items:
            self._last = (items, grading.grade_batch(items, time_limit=self.time_limit, workers=self.workers))
        return self._last[1]

    def reward(self, example: Example, completion: str) -> Reward:
        if self.funcs or self.grader == "math":
            return self.reward_batch([example], [completion])[0]
        correct = self.correct(example, completion)
        return Reward(total=1.0 * correct, components={"correct": 1.0 * correct})

    def correct(self, example: Example, completion: str) -> bool:
        """number / exact graders (math goes through the pool)."""
        if self.grader == "number":
            value, gold = completion_number(completion), gold_number(example.answer)
            return value is not None and gold is not None and math.isclose(value, gold, rel_tol=1e-6, abs_tol=1e-9)
        answer = completion_text(completion)
        return answer is not None and same_words(answer, example.answer)

    def function_rewards(self, examples: list[Example], completions: list[str] | list[list[dict[str, str]]],
                         **extra: list[Any]) -> list[Reward]:
        """The reward functions' weighted sum, each function's values a component; None: unscored. A completion
        is a text (shown as one assistant message when the prompts are chat messages) or a list of messages (an
        episode's, shown as it is); `extra` keyword lists go to the functions beside the columns
        (environments=)."""
        kwargs = self.function_kwargs(examples, completions, **extra)
        rewards = [Reward(total=0.0, components={}, counts={"unscored": 0}) for _ in examples]
        for name, fn, weight in self.funcs:
            values = self.call_function(name, fn, list(zip(examples, completions)), kwargs)
            problem = values_problem(values, len(examples))
            if problem:
                raise ValueError(f"reward function {name} {problem}")
            for r, v in zip(rewards, values):
                if v is None:
                    r.counts["unscored"] += 1
                    continue
                v = float(v)
                r.components[name] = v
                r.total += weight * v
        return rewards

    def function_kwargs(self, examples: list[Example], completions: list[str] | list[list[dict[str, str]]],
                        **extra: list[Any]) -> dict[str, list[Any]]:
        """The keywords a reward function gets for these completions: prompts=, completions=, every column (but
        prompt and completion) as a list, and `extra` (environments=)."""
        conversational = any(self.is_messages(ex.meta.get(self.prompt_field)) for ex in examples)
        prompts = [ex.meta.get(self.prompt_field) for ex in examples]
        shown = [[{"role": "assistant", "content": c}] if conversational and isinstance(c, str) else c for c in completions]
        columns = {k: [ex.meta.get(k) for ex in examples] for k in examples[0].meta if k not in ("prompt", "completion")}
        return {"prompts": prompts, "completions": shown, **columns, **extra}

    def check_functions(self, environments: bool = False) -> None:
        """Each reward function tried at start (task_from_config) on the first training row, so that one that cannot
        work stops the run in one ConfigError line instead of scoring every completion 0 to the end. Its signature
        must take the keywords it is called with (prompts=, completions=, the row's columns, and environments= for an
        environment_factory's: `environments`), read without calling it; then, except for an environment_factory's
        (whose environments are its episodes'), one call within user_code_timeout on two completions, an empty one
        and one answering the row's gold in \\boxed{}, must return a list of 2 values, each a number or None. A call
        that raises stops the run too (a reward function must score any completion: None for one it cannot); one
        that overruns is one warning line (a slow judge may still score a batch within the limit)."""
        if not self.funcs:
            return
        example = self.example(self.train_rows[0])
        gold = example.answer if example.answer is not None else "42"
        completions = ["", f"The answer is \\boxed{{{gold}}}."]
        kwargs = self.function_kwargs([example, example], completions,
                                      **({"environments": [None, None]} if environments else {}))
        columns = [k for k in kwargs if k not in FUNCTION_KEYWORDS]
        for name, fn, _ in self.funcs:
            shown = called_as(name, fn)
            problem = signature_problem(fn, kwargs)
            if problem:
                raise ConfigError(f"reward_funcs: {shown} must take (prompts, completions, **columns), the keywords "
                                  f"TRL's signature calls it with (here prompts, completions and the columns "
                                  f"{', '.join(columns) or 'none'}): {problem}; write it as def {name}(prompts, "
                                  "completions, **kwargs) and read a column as kwargs['answer']")
            if environments:
                continue
            ran, values = tried_at_start(lambda: user_calls(self).call(f"reward function {name}", fn, **kwargs),  # noqa: B023
                                         f"reward_funcs: {name}", "the first training row with the completions "
                                         f"{completions!r}", "batch")
            if not ran:
                continue
            problem = values_problem(values, 2)
            if problem:
                raise ConfigError(f"reward_funcs: {name} {problem}; it must return a list with a float or None for "
                                  "each completion (TRL's signature: f(prompts, completions, **columns) -> "
                                  "list[float | None])")

    def call_function(self, name: str, fn: Any, items: list[tuple[Example, Any]], kwargs: dict[str, Any]) -> Any:
        """One reward function's call on a batch, bounded by user_code_timeout (tasks/workers.py: UserCalls: killed
        in a worker process, or abandoned on a thread). An overrun raises CallTimeout: scoring counts the batch's
        completions as reward errors (each scores 0) and asks again one completion at a time; those of the batch
        that overran get the same CallTimeout at once, without another call (a function that hangs costs one limit
        per batch, not one per completion)."""
        if self._overran is not None and self._overran[0] == name and all(
                any(ex is e and c == seen for e, seen in self._overran[1]) for ex, c in items):
            raise CallTimeout(self._overran[2])
        try:
            return user_calls(self).call(f"reward function {name}", fn, **kwargs)
        except CallTimeout as e:
            self._overran = (name, items, str(e))
            raise

    def unread_hint(self, golds: list[str], completions: list[str]) -> str | None:
        """unread_hint for this task's grader on a step's or an eval's completions (None with reward functions)."""
        if self.funcs or not self.needs_answer:
            return None
        return unread_hint(self.grader, list(zip(completions, golds, strict=True)))

    def judge(self, examples: list[Example], completions: list[str]) -> list[Judgement] | None:
        """Sampled eval's verdicts (pass@k, maj@k); reward functions say nothing about correctness."""
        if self.funcs:
            return None
        if self.grader == "math":
            verdicts = self.verdicts(examples, completions)
            return [Judgement(v.correct, v.extracted) for v in verdicts]
        answer = completion_number if self.grader == "number" else completion_text
        return [Judgement(self.correct(ex, c), answer(c)) for ex, c in zip(examples, completions, strict=True)]

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        rewards = self.reward_batch(examples, completions)
        if self.funcs:
            names = [n for n, _, _ in self.funcs]
            return {n: mean_of([r.components.get(n, 0.0) for r in rewards]) for n in names}
        return {"correct": mean_of([r.components["correct"] > 0 for r in rewards])}
