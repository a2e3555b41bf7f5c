"""The task interface: data + prompt builder + `reward()` + `evaluate()`, sharing one grader."""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Example:
    """One prompt to complete and what its grader needs."""

    messages: list[dict[str, str]]  # chat messages (system, user) rendered by the model's template
    answer: Any  # what the grader compares against (an int for format_copy, a gold string for math)
    meta: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # in a mixture (tasks/mixture.py): the name of the task it came from


@dataclass
class Reward:
    """A scored completion: `total` is the sum of `components` (each logged as reward/<name>, the
    mean over the step); `counts` are diagnostics outside the reward (logged as reward/<name>, summed
    over the step), e.g. grading timeouts; `metrics` are numbers logged and never summed into the total
    (reward/<name>: the mean over the step's completions that report it), e.g. a score per dataset of a
    mixture."""

    total: float
    components: dict[str, float]
    counts: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Judgement:
    """A completion judged by its task's own correctness, for sampled eval (pass@k, maj@k)."""

    correct: bool
    answer: Hashable | None = None  # the answer as the task compares them (None: no answer), for maj@k


class Task(Protocol):
    name: str
    eval_n_default: int

    def sample_train_batch(self, n: int) -> list[Example]: ...

    def eval_examples(self, n: int) -> list[Example]: ...

    def reward(self, example: Example, completion: str) -> Reward: ...

    # Optional: `judge(examples, completions) -> list[Judgement]`, the task's correctness and answer per
    # completion (pass@k, maj@k in sampled eval); without it, a reward component named "correct" is used.
    # Optional: `eval_max_new_tokens: int`, a cap on eval's max_new_tokens (format_copy: 24, as the starter).
    # Optional: `reward_batch(examples, completions) -> list[Reward]`, used instead of `reward` when a
    # task can grade a whole step at once (math_hard's verify mode grades on all cores).

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SeededSampling:
    """Mixin: the task's own RNG, saved and restored with checkpoints."""

    rng: random.Random

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def mean_of(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0
