"""format_copy: copy a random integer into exactly one <answer> tag (reward max 1.3)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from llmrl.tasks.base import Example, Reward, SeededSampling, mean_of

SYSTEM = (
    "You are a strict formatter.\n"
    "Return the final answer as XML using exactly one tag: <answer>...</answer>.\n"
    "Output only the XML tag and nothing else."
)
USER = "Copy this integer exactly: {target}"
LOW, HIGH = -5000, 5000
EVAL_SEED = 1234  # fixed, so every run evaluates on the same targets

THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
ONLY_TAG = re.compile(r"\s*<answer>((?:(?!</?answer>).)*)</answer>\s*", re.IGNORECASE | re.DOTALL)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
WEIGHTS = {"has_tag": 0.2, "strict": 0.1, "exact": 1.0}


@dataclass(frozen=True)
class FormatGrade:
    has_tag: bool  # contains <answer>…</answer>
    strict: bool  # the whole text is exactly one tag (surrounding whitespace allowed)
    exact: bool  # the first tag holds the target


def tag_number(content: str) -> float | None:
    """The number in a tag: the content itself if it is a plain number, else the last number in it."""
    content = content.strip()
    if NUMBER.fullmatch(content):
        return float(content.replace(",", ""))
    found = NUMBER.findall(content)
    return float(found[-1].replace(",", "")) if found else None


def grade(completion: str, target: int) -> FormatGrade:
    """The one grader behind both reward and eval. `<think>…</think>` blocks are removed first."""
    text = THINK.sub("", completion)
    first = TAG.search(text)
    value = tag_number(first.group(1)) if first else None
    return FormatGrade(
        has_tag=first is not None,
        strict=ONLY_TAG.fullmatch(text) is not None,
        exact=value is not None and value == target,
    )


class FormatCopyTask(SeededSampling):
    name = "format_copy"
    eval_n_default = 64

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    @staticmethod
    def example(target: int) -> Example:
        return Example(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER.format(target=target)}],
            answer=target,
        )

    def sample_train_batch(self, n: int) -> list[Example]:
        return [self.example(self.rng.randint(LOW, HIGH)) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        rng = random.Random(EVAL_SEED)
        return [self.example(rng.randint(LOW, HIGH)) for _ in range(n)]

    def reward(self, example: Example, completion: str) -> Reward:
        g = grade(completion, example.answer)
        components = {k: WEIGHTS[k] * float(getattr(g, k)) for k in WEIGHTS}
        return Reward(total=sum(components.values()), components=components)

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        grades = [grade(c, ex.answer) for ex, c in zip(examples, completions, strict=True)]
        return {
            "exact_match": mean_of([g.exact for g in grades]),
            "has_tag": mean_of([g.has_tag for g in grades]),
            "strict": mean_of([g.strict for g in grades]),
        }
