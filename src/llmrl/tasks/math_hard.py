"""math_hard: level-5 MATH problems with numeric gold answers, answered as \\boxed{NUMBER} (reward max 1.1)."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrl import grading
from llmrl.errors import DataError
from llmrl.tasks.base import Example, Reward, SeededSampling, mean_of

SYSTEM = (
    "Solve the competition-level math problem.\n"
    "Return the final answer in this exact format: \\boxed{NUMBER}\n"
    "Do not output XML, ####, or extra prose.\n"
    "Output only the boxed final answer."
)
USER = "{problem}\n\nReturn only: \\boxed{{NUMBER}}"
HUB_DATASET = "the-jb/hendrycks-math"
LEVEL = "Level 5"
TOLERANCE = 1e-6

NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_PLAIN = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_FRAC = re.compile(r"([-+]?)\\[dt]?frac\{(" + _PLAIN + r")\}\{(" + _PLAIN + r")\}")
_SLASH = re.compile(r"(" + _PLAIN + r")/(" + _PLAIN + r")")
_MIXED = re.compile(r"([-+]?)(\d+)\\[dt]?frac\{(\d+)\}\{(\d+)\}")
_TEXT = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$")
_SPACING = re.compile(r"\\[!,;: ]|\$|\s")


def last_boxed(text: str) -> str | None:
    """The seed's extraction: content of the last `\\boxed{…}` with balanced braces; None if absent
    or unclosed."""
    return grading.last_boxed(text, commands=("\\boxed",))


def parse_number(s: str) -> float | None:
    """A numeric answer as a float: integers, decimals, a/b, \\frac{a}{b}, mixed numbers, \\text{n}.

    Anything else (radicals, intervals, expressions, words) is None: the seed keeps only numeric golds.
    """
    s = _SPACING.sub("", s)
    while (m := _TEXT.match(s)) is not None:
        s = m.group(1)
    s = s.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    if re.fullmatch(_PLAIN, s):
        return float(s)
    if m := _MIXED.fullmatch(s):
        sign = -1.0 if m.group(1) == "-" else 1.0
        whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
        return sign * (whole + num / den) if den else None
    for pattern in (_FRAC, _SLASH):
        if m := pattern.fullmatch(s):
            groups = m.groups()
            sign = -1.0 if len(groups) == 3 and groups[0] == "-" else 1.0
            num, den = float(groups[-2]), float(groups[-1])
            return sign * num / den if den else None
    return None


def last_number(text: str) -> float | None:
    """The last number written anywhere in the text (thousands commas allowed)."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) <= TOLERANCE


@dataclass(frozen=True)
class MathGrade:
    boxed: bool  # the text contains \boxed{
    boxed_exact: bool  # the last boxed content is the gold number
    relaxed: bool  # the last number anywhere in the text is the gold number


def grade(completion: str, gold: float) -> MathGrade:
    """The one grader behind both reward and eval."""
    content = last_boxed(completion)
    return MathGrade(
        boxed="\\boxed{" in completion,
        boxed_exact=content is not None and close(parse_number(content), gold),
        relaxed=close(last_number(completion), gold),
    )


def read_rows(path: Path) -> list[Any]:
    """Rows of a local JSONL or Parquet file. A JSONL line that is not valid JSON becomes None (it is
    counted and dropped later); invalid UTF-8 is replaced, so such text is dropped as invalid too."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows: list[Any] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    rows.append(None)
    return rows


def load_split(source: str | None, split: str) -> list[dict[str, Any]]:
    """MATH rows of one split from the hub (default) or a local source.

    A local source is either a directory holding `train.jsonl`/`test.jsonl` (or `.parquet`), or one
    file whose rows may carry a `split` field (rows without it are used for both splits).
    """
    if source is None:
        from datasets import load_dataset

        return list(load_dataset(HUB_DATASET, split=split))
    path = Path(source)
    if path.is_dir():
        files = [p for p in (path / f"{split}.jsonl", path / f"{split}.parquet") if p.exists()]
        if not files:
            raise DataError(f"math_data '{source}': no {split}.jsonl or {split}.parquet inside")
        return read_rows(files[0])
    return [r for r in read_rows(path) if not isinstance(r, dict) or r.get("split", split) == split]


def why_dropped(row: Any, numeric: bool = True) -> str | None:
    """The reason a row is unusable, or None if it is a level-5 problem with a boxed gold answer (a
    numeric one when `numeric`, the seed's rule)."""
    if not isinstance(row, dict):
        return "not a JSON object"
    for key in ("problem", "solution", "level"):
        if key not in row or row[key] is None:
            return f"missing {key}"
        if not isinstance(row[key], str):
            return f"{key} is not text"
        if not row[key].strip():
            return f"empty {key}"
        if "\x00" in row[key] or "\ufffd" in row[key]:
            return f"invalid characters in {key}"
    if row["level"] != LEVEL:
        return "not level 5"
    boxed = last_boxed(row["solution"]) if numeric else grading.gold_from_solution(row["solution"])
    if boxed is None:
        return "no boxed answer"
    if numeric and parse_number(boxed) is None:
        return "non-numeric answer"
    return None


def level5(rows: list[Any], mode: str = "seed", time_limit: float = grading.DEFAULT_TIME_LIMIT,
           workers: int | None = None) -> tuple[list[dict[str, Any]], Counter]:
    """Keep the usable level-5 problems in order, with `gold` and `gold_text`; count the others by
    reason. seed: numeric golds only (gold is a float). verify: every gold math-verify can read
    (gold is the answer text)."""
    kept, dropped = [], Counter()
    for row in rows:
        reason = why_dropped(row, numeric=mode == "seed")
        if reason is not None:
            dropped[reason] += 1
        elif mode == "seed":
            boxed = last_boxed(row["solution"])
            kept.append({**row, "gold": parse_number(boxed), "gold_text": boxed})
        else:
            boxed = grading.gold_from_solution(row["solution"])
            kept.append({**row, "gold": boxed, "gold_text": boxed})
    if mode == "verify" and kept:
        readable = grading.gold_parses([row["gold"] for row in kept], time_limit=time_limit, workers=workers)
        dropped["gold answer unreadable by math-verify"] += readable.count(False)
        kept = [row for row, ok in zip(kept, readable) if ok]
        dropped = +dropped  # drop zero counts
    return kept, dropped


def numeric_level5(rows: list[Any]) -> tuple[list[dict[str, Any]], Counter]:
    """The seed's pool: level-5 problems whose gold (last boxed answer of the solution) is numeric."""
    return level5(rows, "seed")


class MathHardTask(SeededSampling):
    """Level-5 MATH. reward="seed": SPEC.md's numeric reward (max 1.1); reward="verify": +0.1 for a
    boxed answer, +1.0 if math-verify finds it equivalent to the gold (every answer type)."""

    name = "math_hard"
    eval_n_default = 512

    def __init__(self, seed: int = 0, data: str | None = None, reward: str = "seed",
                 time_limit: float = grading.DEFAULT_TIME_LIMIT, workers: int | None = None):
        self.rng = random.Random(seed)
        self.mode, self.time_limit, self.workers = reward, time_limit, workers
        self._last: tuple[list, list[grading.Verdict]] = ([], [])  # the last graded batch and its verdicts
        self.train_rows, train_dropped = level5(load_split(data, "train"), reward, time_limit, workers)
        self.test_rows, test_dropped = level5(load_split(data, "test"), reward, time_limit, workers)
        self.data_report = {
            "reward": reward,
            "train": {"kept": len(self.train_rows), "dropped": dict(train_dropped)},
            "test": {"kept": len(self.test_rows), "dropped": dict(test_dropped)},
        }
        if not self.train_rows or not self.test_rows:
            kind = "numeric answers" if reward == "seed" else "answers math-verify can read"
            raise DataError(
                f"math_data '{data or HUB_DATASET}': no level-5 problems with {kind} "
                f"(train kept {len(self.train_rows)}, dropped {dict(train_dropped)}; "
                f"test kept {len(self.test_rows)}, dropped {dict(test_dropped)})"
            )

    @staticmethod
    def example(row: dict[str, Any]) -> Example:
        return Example(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER.format(problem=row["problem"])}],
            answer=row["gold"],
            meta={"gold_text": row["gold_text"], "type": row.get("type")},
        )

    def sample_train_batch(self, n: int) -> list[Example]:
        return [self.example(self.rng.choice(self.train_rows)) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        return [self.example(r) for r in self.test_rows[:n]]

    def verdicts(self, examples: list[Example], completions: list[str]) -> list[grading.Verdict]:
        """math-verify verdicts; the last batch is remembered (eval asks for rewards and metrics)."""
        items = [(c, ex.answer) for ex, c in zip(examples, completions, strict=True)]
        if self._last[0] != items:
            self._last = (items, grading.grade_batch(items, time_limit=self.time_limit, workers=self.workers))
        return self._last[1]

    @staticmethod
    def verify_reward(v: grading.Verdict) -> Reward:
        components = {"boxed": 0.1 * (v.extracted is not None), "correct": 1.0 * v.correct}
        counts = {"grade_timeouts": int(v.status == "timeout"), "grade_errors": int(v.status == "error")}
        return Reward(total=sum(components.values()), components=components, counts=counts)

    def reward_batch(self, examples: list[Example], completions: list[str]) -> list[Reward]:
        if self.mode == "verify":
            return [self.verify_reward(v) for v in self.verdicts(examples, completions)]
        return [self.reward(ex, c) for ex, c in zip(examples, completions, strict=True)]

    def reward(self, example: Example, completion: str) -> Reward:
        if self.mode == "verify":
            return self.verify_reward(self.verdicts([example], [completion])[0])
        g = grade(completion, example.answer)
        components = {
            "boxed": 0.1 * g.boxed,
            "boxed_exact": 1.0 * g.boxed_exact,
            "relaxed": 0.1 * (g.relaxed and not g.boxed_exact),
        }
        return Reward(total=sum(components.values()), components=components)

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        if self.mode == "verify":
            verdicts = self.verdicts(examples, completions)
            return {
                "correct": mean_of([v.correct for v in verdicts]),
                "boxed_rate": mean_of([v.extracted is not None for v in verdicts]),
                "grade_timeouts": float(sum(v.status == "timeout" for v in verdicts)),
            }
        grades = [grade(c, ex.answer) for ex, c in zip(examples, completions, strict=True)]
        return {
            "boxed_exact": mean_of([g.boxed_exact for g in grades]),
            "relaxed_exact": mean_of([g.relaxed for g in grades]),
            "boxed_rate": mean_of([g.boxed for g in grades]),
        }
