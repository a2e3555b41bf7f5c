"""math_hard: level-5 MATH problems with numeric gold answers, answered as \\boxed{NUMBER} (reward max 1.1)."""

from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrl import grading
from llmrl.errors import DataError
from llmrl.tasks import seed_parsing
from llmrl.tasks.base import Example, Judgement, Reward, SeededSampling, mean_of

SYSTEM = (
    "Solve the competition-level math problem.\n"
    "Return the final answer in this exact format: \\boxed{NUMBER}\n"
    "Do not output XML, ####, or extra prose.\n"
    "Output only the boxed final answer."
)
USER = "{problem}\n\nReturn only: \\boxed{{NUMBER}}"
HUB_DATASET = "the-jb/hendrycks-math"
LEVEL = 5
LEVEL_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class MathGrade:
    """The seed's verdicts on one completion (tasks/seed_parsing.py has the parsing rules)."""

    boxed_keyword: bool  # the lower-cased raw text contains `\boxed{` (the +0.1 format reward)
    boxed: bool  # a closed `\boxed{…}` is present (eval/boxed_rate)
    boxed_exact: bool  # the last closed boxed answer is a number within 1e-6 of the gold
    boxed_parses: bool  # that boxed answer is a number at all
    last_exact: bool  # the last number anywhere in the text equals the gold


def grade(completion: str, gold: float) -> MathGrade:
    """The one grader behind both reward and eval."""
    content = seed_parsing.last_boxed(completion)
    value = None if content is None else seed_parsing.parse_number(content)
    return MathGrade(
        boxed_keyword="\\boxed{" in completion.lower(),
        boxed=content is not None,
        boxed_exact=seed_parsing.matches(value, gold),
        boxed_parses=value is not None,
        last_exact=seed_parsing.matches(seed_parsing.last_number(completion), gold),
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

        quiet = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "fsspec")]
        levels = [log.level for log in quiet]
        for log in quiet:
            log.setLevel(logging.ERROR)  # the hub client's retry lines would precede our one-line error
        try:
            return list(load_dataset(HUB_DATASET, split=split))
        except Exception as e:  # noqa: BLE001 - offline, no such dataset, a hub outage: all mean "give a file"
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise DataError(f"math_hard: could not load {HUB_DATASET} ({split}) from the Hugging Face hub "
                            f"({type(e).__name__}: {first}); give a local copy with --math_data FILE.jsonl|.parquet|DIR "
                            "(rows with problem, solution, level)") from None
        finally:
            for log, level in zip(quiet, levels):
                log.setLevel(level)
    path = Path(source)
    if path.is_dir():
        files = [p for p in (path / f"{split}.jsonl", path / f"{split}.parquet") if p.exists()]
        if not files:
            raise DataError(f"math_data '{source}': no {split}.jsonl or {split}.parquet inside")
        return read_rows(files[0])
    return [r for r in read_rows(path) if not isinstance(r, dict) or r.get("split", split) == split]


def level_of(value: Any) -> int | None:
    """The starter's level: the first integer written in the value ("Level 5", 5, "5" → 5)."""
    m = LEVEL_NUMBER.search(str(value))
    return int(m.group()) if m else None


def _text_field(row: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(stripped text, None) from the first of `keys` present in the row, or (None, why it is unusable)."""
    key = next((k for k in keys if k in row), keys[0])
    value = row.get(key)
    if value is None:
        return None, f"missing {keys[0]}"
    if not isinstance(value, str):
        return None, f"{keys[0]} is not text"
    if not value.strip():
        return None, f"empty {keys[0]}"
    if "\x00" in value or "\ufffd" in value:
        return None, f"invalid characters in {keys[0]}"
    return value.strip(), None


def usable_row(row: Any, mode: str = "seed") -> tuple[dict[str, Any] | None, str | None]:
    """(row with problem, solution, level, gold, gold_text; None) for a usable level-5 problem, else
    (None, the reason it is dropped).

    The starter's `_build_rows`: the level is the first integer of `level` (or `difficulty`); problem
    and solution come from `problem`/`question`/`prompt` and `solution`/`answer`/`final_answer`,
    stripped. seed: the gold is the last boxed answer of the solution read as a number, else the whole
    solution as a number, and must be finite. verify: the last boxed answer as text (math-verify reads
    it later). Beyond the starter, rows that are not objects or whose text is missing, not a string or
    holds NUL/replacement characters are dropped (the starter would train on the text "None").
    """
    if not isinstance(row, dict):
        return None, "not a JSON object"
    level = level_of(row.get("level", row.get("difficulty")))
    if level is None:
        return None, "missing level"
    if level != LEVEL:
        return None, "not level 5"
    problem, why = _text_field(row, ("problem", "question", "prompt"))
    if why:
        return None, why
    solution, why = _text_field(row, ("solution", "answer", "final_answer"))
    if why:
        return None, why
    if mode == "seed":
        gold = seed_parsing.solution_gold(solution)
        if gold is None:
            return None, "non-numeric answer" if seed_parsing.last_boxed(solution) is not None else "no numeric answer"
        boxed = seed_parsing.last_boxed(solution)
        gold_text = boxed if boxed is not None and seed_parsing.parse_number(boxed) is not None else solution
    else:
        gold = gold_text = grading.gold_from_solution(solution)
        if gold is None:
            return None, "no boxed answer"
    return {**row, "problem": problem, "solution": solution, "level": level, "gold": gold, "gold_text": gold_text}, None


def level5(rows: list[Any], mode: str = "seed", time_limit: float = grading.DEFAULT_TIME_LIMIT,
           workers: int | None = None) -> tuple[list[dict[str, Any]], Counter]:
    """Keep the usable level-5 problems in order (see usable_row); count the others by reason.
    seed: numeric golds only (gold is a float). verify: golds as answer text; those that normalise to nothing are
    dropped here, the others are read by math-verify when their row is first drawn (MathHardTask)."""
    kept, dropped = [], Counter()
    for row in rows:
        usable, reason = usable_row(row, mode)
        if usable is None:
            dropped[reason] += 1
        else:
            kept.append(usable)
    if mode == "verify" and kept:  # what needs no math-verify; the rest is read when drawn (grading.draw_readable)
        readable = [grading.gold_readable_here(row["gold"]) is not False for row in kept]
        dropped["gold answer unreadable by math-verify"] += readable.count(False)
        kept = [row for row, ok in zip(kept, readable) if ok]
        dropped = +dropped  # drop zero counts
    return kept, dropped


def _gold(row: dict[str, Any]) -> Any:
    return row["gold"]


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
            **({"math_verify_reads_golds": "when drawn"} if reward == "verify" else {}),
        }
        self.source = data or HUB_DATASET
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
        if self.mode == "verify":  # only rows whose gold math-verify reads, each read when first drawn
            return [self.example(r) for r in grading.draw_readable(
                self.train_rows, n, self.rng, _gold, what=f"math_data '{self.source}' (train)",
                time_limit=self.time_limit, workers=self.workers)]
        return [self.example(self.train_rows[self.rng.randrange(len(self.train_rows))]) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        if self.mode == "verify":
            return [self.example(r) for r in grading.first_readable(self.test_rows, n, _gold, time_limit=self.time_limit,
                                                                    workers=self.workers)]
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
            "boxed": 0.1 * g.boxed_keyword,
            "boxed_exact": 1.0 * g.boxed_exact,
            "relaxed": 0.1 * (g.last_exact and not g.boxed_parses),  # only when the boxed answer is no number
        }
        return Reward(total=sum(components.values()), components=components)

    def judge(self, examples: list[Example], completions: list[str]) -> list[Judgement]:
        """seed: correct is boxed_exact, the answer the boxed number; verify: math-verify's verdict, the
        answer the extracted boxed text."""
        if self.mode == "verify":
            return [Judgement(v.correct, v.extracted) for v in self.verdicts(examples, completions)]
        return [Judgement(grade(c, ex.answer).boxed_exact, seed_parsing.boxed_number(c))
                for ex, c in zip(examples, completions, strict=True)]

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
            "relaxed_exact": mean_of([g.boxed_exact or g.last_exact for g in grades]),
            "boxed_rate": mean_of([g.boxed for g in grades]),
        }
