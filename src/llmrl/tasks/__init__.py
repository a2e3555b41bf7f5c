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


def make_task(name: str, seed: int, math_data: str | None = None, **math_options) -> Task:
    """Build a task by name; its RNG is seeded from the run's seed. `math_options` (reward,
    time_limit, workers) go to math_hard."""
    if name == "math_hard":
        return MathHardTask(seed=seed, data=math_data, **math_options)
    if name in TASKS:
        return TASKS[name](seed=seed)
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)(seed=seed)


def task_from_config(cfg, rank: int = 0) -> Task:
    """The task a TrainConfig asks for (seeded by seed + rank)."""
    return make_task(cfg.task, seed=cfg.seed + rank, math_data=cfg.math_data, reward=cfg.math_reward,
                     time_limit=cfg.grade_time_limit, workers=cfg.grade_workers)


def is_task_name(name: str) -> bool:
    """A registered name, or something shaped like `package.module:ClassName`."""
    module, sep, attr = name.partition(":")
    return name in TASKS or bool(sep and module and attr.isidentifier())


__all__ = ["TASKS", "Example", "is_task_name", "Reward", "Task", "make_task", "task_from_config"]
