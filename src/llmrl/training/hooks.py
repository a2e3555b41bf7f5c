"""Named points in a run where extra code may run: fault-injection tests and tools attach here
instead of patching module attributes.

    before_rollout    at the start of each rollout (step=...)
    after_checkpoint  after a checkpoint is complete (path=...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

POINTS = ("before_rollout", "after_checkpoint")
_callbacks: dict[str, list[Callable[..., Any]]] = {p: [] for p in POINTS}


def on(point: str, fn: Callable[..., Any]) -> Callable[[], None]:
    """Call `fn(**info)` at `point` from now on; returns a function that removes it again."""
    if point not in _callbacks:
        raise ValueError(f"unknown hook point {point!r} (known: {', '.join(POINTS)})")
    _callbacks[point].append(fn)
    return lambda: _callbacks[point].remove(fn)


def fire(point: str, **info: Any) -> None:
    for fn in list(_callbacks[point]):
        fn(**info)
