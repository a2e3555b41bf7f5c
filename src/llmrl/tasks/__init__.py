"""Task registry: `--task NAME` picks a class from `TASKS`; `--task package.module:ClassName`
imports a user task (a class with the `Task` methods, constructed as `ClassName(seed=...)`)."""

from __future__ import annotations

import importlib

from llmrl.tasks.base import Example, Reward, Task
from llmrl.tasks.format_copy import FormatCopyTask
from llmrl.tasks.math_hard import MathHardTask

TASKS: dict[str, type] = {
    "format_copy": FormatCopyTask,
    "math_hard": MathHardTask,
}


def make_task(name: str, seed: int, math_data: str | None = None) -> Task:
    """Build a task by name; its RNG is seeded from the run's seed."""
    if name == "math_hard":
        return MathHardTask(seed=seed, data=math_data)
    if name in TASKS:
        return TASKS[name](seed=seed)
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)(seed=seed)


def is_task_name(name: str) -> bool:
    """A registered name, or something shaped like `package.module:ClassName`."""
    module, sep, attr = name.partition(":")
    return name in TASKS or bool(sep and module and attr.isidentifier())


__all__ = ["TASKS", "Example", "is_task_name", "Reward", "Task", "make_task"]
