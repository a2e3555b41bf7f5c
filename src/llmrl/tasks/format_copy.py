"""format_copy: copy a random integer into exactly one <answer> tag (reward max 1.3)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmrl.tasks import seed_parsing
from llmrl.tasks.base import Example, Judgement, Reward, SeededSampling, mean_of

SYSTEM = (
    "You are a strict formatter.\n"
    "Return the final answer as XML using exactly one tag: <answer>...</answer>.\n"
    "Output only the XML tag and nothing else."
)
USER = "Copy this integer exactly: {target}"
LOW, HIGH = -5000, 5000
EVAL_SEED_OFFSET = 123  # eval targets come from random.Random(seed + 123), as in the starter (123 at seed 0)
WEIGHTS = {"has_tag": 0.2, "strict": 0.1, "exact": 1.0}


@dataclass(frozen=True)
class FormatGrade:
    has_tag: bool  # contains <answer>…</answer>
    strict: bool  # the whole text starts with <answer> and ends with </answer> (surrounding whitespace allowed)
    exact: bool  # the first tag holds the target (within 1e-6)


def grade(completion: str, target: int) -> FormatGrade:
    """The one grader behind both reward and eval: the starter's rules (tasks/seed_parsing.py)."""
    return FormatGrade(
        has_tag=seed_parsing.answer_tag(completion) is not None,
        strict=seed_parsing.is_only_answer_tag(completion),
        exact=seed_parsing.matches(seed_parsing.tag_number(completion), float(target)),
    )


class FormatCopyTask(SeededSampling):
    name = "format_copy"
    eval_n_default = 64
    eval_max_new_tokens = 24  # the starter evaluates format_copy with min(max_new_tokens, 24)

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.eval_seed = seed + EVAL_SEED_OFFSET

    @staticmethod
    def example(target: int) -> Example:
        return Example(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER.format(target=target)}],
            answer=target,
        )

    def sample_train_batch(self, n: int) -> list[Example]:
        return [self.example(self.rng.randint(LOW, HIGH)) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        rng = random.Random(self.eval_seed)
        return [self.example(rng.randint(LOW, HIGH)) for _ in range(n)]

    def reward(self, example: Example, completion: str) -> Reward:
        g = grade(completion, example.answer)
        components = {k: WEIGHTS[k] * float(getattr(g, k)) for k in WEIGHTS}
        return Reward(total=sum(components.values()), components=components)

    def judge(self, examples: list[Example], completions: list[str]) -> list[Judgement]:
        """Correct: exact; the answer is the first tag's number."""
        return [Judgement(grade(c, ex.answer).exact, seed_parsing.tag_number(c)) for ex, c in zip(examples, completions, strict=True)]

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        grades = [grade(c, ex.answer) for ex, c in zip(examples, completions, strict=True)]
        return {
            "exact_match": mean_of([g.exact for g in grades]),
            "has_tag": mean_of([g.has_tag for g in grades]),
            "strict": mean_of([g.strict for g in grades]),
        }
