"""Task registry: `--task NAME` picks a class from `TASKS` (or a function registered with
`register_reward`); `--task package.module:Name` or `--task file.py:Name` loads a user task class
(constructed as `Name(seed=...)`) or a plain reward function (with `--prompts`); see tasks/custom.py."""

from __future__ import annotations

from pathlib import Path

from llmrl.tasks.base import Example, Reward, Task
from llmrl.tasks.calculator import CalculatorEnv
from llmrl.tasks.custom import REWARD_FUNCTIONS, FunctionTask, build_custom, register_reward
from llmrl.tasks.env import Environment, Episode, Turn, is_environment
from llmrl.tasks.format_copy import FormatCopyTask
from llmrl.tasks.guess import GuessEnv
from llmrl.tasks.math_hard import MathHardTask

TASKS: dict[str, type] = {
    "format_copy": FormatCopyTask,
    "math_hard": MathHardTask,
    "calculator": CalculatorEnv,
    "guess": GuessEnv,
}


def register_env(name: str, cls: type | None = None):
    """Register an environment class (tasks/env.py: Environment) as task `name`, built as cls(seed=...).
    Usable as a call or as a class decorator: `@register_env("maze")`."""

    def add(c: type) -> type:
        if not getattr(c, "is_environment", False):
            raise TypeError(f"register_env({name!r}): {c.__name__} is not an Environment (subclass llmrl.Environment)")
        TASKS[name] = c
        return c

    return add(cls) if cls is not None else add


def make_task(name: str, seed: int, math_data: str | None = None, prompts: str | None = None, **math_options) -> Task:
    """Build a task by name; its RNG is seeded from the run's seed. `math_options` (reward,
    time_limit, workers) go to math_hard."""
    if name == "math_hard":
        return MathHardTask(seed=seed, data=math_data, **math_options)
    if name in TASKS:
        return TASKS[name](seed=seed)
    return build_custom(name, seed, prompts)


def task_from_config(cfg) -> Task:
    """The task a TrainConfig asks for, seeded by cfg.seed (every rank draws the same prompts)."""
    return make_task(cfg.task, seed=cfg.seed, math_data=cfg.math_data, prompts=cfg.prompts, reward=cfg.math_reward,
                     time_limit=cfg.grade_time_limit, workers=cfg.grade_workers)


def is_task_name(name: str) -> bool:
    """A registered name, an existing `file.py:Name`, or something shaped like `package.module:Name`."""
    module, sep, attr = name.rpartition(":")
    if name in TASKS or name in REWARD_FUNCTIONS:
        return True
    if module.endswith(".py"):
        return Path(module).is_file() and attr.isidentifier()
    return bool(sep and module and attr.isidentifier())


__all__ = ["TASKS", "register_env", "Environment", "Episode", "Turn", "is_environment", "Example", "FunctionTask", "is_task_name", "Reward", "Task", "make_task", "register_reward",
           "task_from_config"]
