"""Common reward functions with TRL's signature, `f(prompts, completions, **columns) -> list[float | None]`, to pass
as reward_funcs (from Python the functions themselves, on the command line `llmrl.rewards:accuracy`):

    import llmrl
    from llmrl import rewards
    cfg = llmrl.load_config(None, {"dataset": "rows.jsonl",
                                   "reward_funcs": [rewards.accuracy, rewards.think_format,
                                                    rewards.soft_overlong_punishment(max_length=2000, cache=500)],
                                   "reward_weights": [1.0, 0.2, 1.0]})

A completion is a text, or a list of chat messages (conversational prompts, an environment's episode): these read
its last assistant message. A gold answer is read from the row's `answer` column, else its `solution` column, as the
dataset task reads one (tasks/dataset.py gold_answer: the text after GSM8K's `#### `, else the last `\\boxed{}`,
else the whole text); a row without one is unscored (None).

    accuracy                  1.0 when the completion's last \\boxed{} answer is the gold by math-verify (the math
                              grader's path, in its bounded pool: grading.grade_batch), else 0.0
    exact_match               1.0 when the completion's last \\boxed{} text, else its last non-empty line, is the gold
                              after collapsing whitespace (the exact grader's rule), else 0.0
    think_format              1.0 for `<think>…</think>` then a non-empty answer, one think block, else 0.0
    soft_overlong_punishment  DAPO's length penalty (max_length, cache): 0 up to max_length - cache, then falling
                              linearly to -1 at max_length, -1 beyond; lengths in characters, or in tokens with a
                              tokenizer
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmrl import grading
from llmrl.tasks.dataset import completion_text, gold_answer, same_words

def content(completion: Any) -> str:
    """A completion's text: itself, or its last assistant message's content ("" when it has none)."""
    if isinstance(completion, str):
        return completion
    replies = [m.get("content") or "" for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    return replies[-1] if replies else ""


def golds(n: int, answer: list[Any] | None, solution: list[Any] | None, who: str) -> list[str | None]:
    """The gold answer of each of `n` rows from the answer column, else the solution column."""
    column = answer if answer is not None else solution
    if column is None:
        raise ValueError(f"{who} reads the gold answer from a column `answer` or `solution`; the dataset has neither "
                         "(rename its gold column)")
    if len(column) != n:
        raise ValueError(f"{who}: {len(column)} gold answers for {n} completions")
    return [gold_answer(v) for v in column]


def accuracy(prompts: list[Any], completions: list[Any], answer: list[Any] | None = None,
             solution: list[Any] | None = None, **columns: Any) -> list[float | None]:
    """1.0 when the completion's last \\boxed{} answer is the row's gold by math-verify, 0.0 when not (or when it
    gives no boxed answer, or grading overran its time limit), None for a row without a gold answer."""
    gold = golds(len(completions), answer, solution, "accuracy")
    verdicts = grading.grade_batch([(content(c), g) for c, g in zip(completions, gold)])
    return [None if g is None else float(v.correct) for g, v in zip(gold, verdicts)]


def exact_match(prompts: list[Any], completions: list[Any], answer: list[Any] | None = None,
                solution: list[Any] | None = None, **columns: Any) -> list[float | None]:
    """1.0 when the completion's answer (its last \\boxed{} text, else its last non-empty line) is the row's gold after
    collapsing whitespace, 0.0 when not, None for a row without a gold answer."""
    gold = golds(len(completions), answer, solution, "exact_match")
    out: list[float | None] = []
    for c, g in zip(completions, gold):
        given = completion_text(content(c))
        out.append(None if g is None else float(given is not None and same_words(given, g)))
    return out


def think_format(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """1.0 when the completion is one `<think>…</think>` block (leading whitespace allowed) followed by a non-empty
    answer with no think tag in it, else 0.0. A chat template that opens `<think>` in the prompt (the completion
    starts inside the block) scores 0 here."""
    return [float(is_think_format(content(c))) for c in completions]


def is_think_format(text: str) -> bool:
    """`<think>…</think>` (after any whitespace) then a non-empty answer, and no other think tag."""
    text = text.lstrip()
    end = text.find("</think>")
    if not text.startswith("<think>") or end < 0:
        return False
    inside, answer = text[len("<think>"):end], text[end + len("</think>"):]
    return "<think>" not in inside and "<think>" not in answer and "</think>" not in answer and bool(answer.strip())


def overlong_penalty(length: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment of one length: 0 up to max_length - cache, (max_length - cache - length) / cache
    above it (-0.35 at length 87 with max_length 100, cache 20), -1 beyond max_length."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return (max_length - cache - length) / cache
    return -1.0


def soft_overlong_punishment(max_length: int, cache: int, tokenizer: Any = None) -> Callable[..., list[float]]:
    """A reward function giving each completion overlong_penalty(its length, max_length, cache): its length in
    characters, or with `tokenizer` (a Hugging Face tokenizer) in tokens, encoded without special tokens. Logged as
    reward/soft_overlong_punishment. The run's own overlong shaping (config overlong_buffer, overlong_penalty) does
    the same in tokens, on the sampled tokens themselves."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"soft_overlong_punishment: max_length={max_length!r} must be a positive integer")
    if isinstance(cache, bool) or not isinstance(cache, int) or not 1 <= cache <= max_length:
        raise ValueError(f"soft_overlong_punishment: cache={cache!r} must be an integer in "
                         f"[1, max_length={max_length}]")

    def length(text: str) -> int:
        return len(text) if tokenizer is None else len(tokenizer.encode(text, add_special_tokens=False))

    def soft_overlong_punishment(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        return [overlong_penalty(length(content(c)), max_length, cache) for c in completions]

    # how a config names it (a run resumed from Python is given it again: this call)
    given = f"max_length={max_length}, cache={cache}" + (", tokenizer=tokenizer" if tokenizer is not None else "")
    soft_overlong_punishment.__qualname__ = f"soft_overlong_punishment({given})"
    return soft_overlong_punishment


__all__ = ["accuracy", "exact_match", "think_format", "soft_overlong_punishment", "overlong_penalty"]
