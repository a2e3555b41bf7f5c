"""User tasks and plain reward functions.

    --task my_pkg.rewards:MyTask          a class with the Task methods, built as MyTask(seed=...)
    --task path/to/rewards.py:MyTask      the same, from a file
    --task path/to/rewards.py:reward --prompts prompts.jsonl
                                          a plain function reward(prompt, completion, **meta) -> float | None

In Python, `register_reward("name", fn, prompts="prompts.jsonl")` (or the decorator form) adds a
function task to the registry so `--task name` finds it. A prompts file has one JSON object per line:
`prompt` (the user message), optional `system`, and any other fields, which reach the reward as `meta`.
Training samples prompts with the run's seed; eval uses the first eval_n prompts in file order.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmrl.errors import ConfigError, DataError
from llmrl.tasks.base import Example, Reward, SeededSampling

RewardFn = Callable[..., "float | None"]


def load_object(spec: str) -> Any:
    """The object named by `module.path:Name` or `file.py:Name`."""
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"task={spec!r}: no such file: {where}")
            name = file_module_name(path)
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
                sys.modules[name] = module  # its classes pickle by this name (env_isolation=process)
                try:
                    module_spec.loader.exec_module(module)  # type: ignore[union-attr]
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's module may fail in any way
        raise ConfigError(f"task={spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise ConfigError(f"task={spec!r}: {where} has no {attr}")
    return getattr(module, attr)


def file_module_name(path: Path) -> str:
    """The module name a task file is loaded under: private to llmrl and unique per file, so a file named
    like a package (textarena.py, json.py) never shadows it, for the file itself or anything imported later."""
    resolved = str(path.resolve())
    return f"_llmrl_task_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{hashlib.sha1(resolved.encode()).hexdigest()[:10]}"


def construct(spec: str, cls: Any, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)` (seed and task_args), or ConfigError naming the arguments it does not take."""
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"task={spec!r}: {getattr(cls, '__name__', cls)} cannot take task_args "
                          f"{sorted(set(kwargs) - {'seed'})}: {e}") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    return cls(**kwargs)


def read_prompts(path: str | None, spec: str) -> list[dict[str, Any]]:
    if path is None:
        raise ConfigError(f"task={spec!r} is a reward function: give its prompts with --prompts FILE.jsonl")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise DataError(f"prompts {path}: line {i} is not valid JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DataError(f"prompts {path}: line {i} needs a text field `prompt`")
            rows.append(row)
    if not rows:
        raise DataError(f"prompts {path}: no prompts")
    return rows


class FunctionTask(SeededSampling):
    """A task made of a prompts list and a plain reward function."""

    name = "function"
    eval_n_default = 16

    def __init__(self, fn: RewardFn, prompts: list[dict[str, Any]], seed: int = 0):
        self.fn, self.prompts, self.rng = fn, prompts, random.Random(seed)

    @staticmethod
    def example(row: dict[str, Any]) -> Example:
        messages = ([{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else [])
        meta = {k: v for k, v in row.items() if k not in ("prompt", "system")}
        return Example(messages=messages + [{"role": "user", "content": row["prompt"]}], answer=meta.get("answer"), meta=meta)

    def sample_train_batch(self, n: int) -> list[Example]:
        return [self.example(self.rng.choice(self.prompts)) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        return [self.example(r) for r in self.prompts[:n]]

    def reward(self, example: Example, completion: str) -> Reward:
        value = self.fn(example.messages[-1]["content"], completion, **example.meta)
        if value is None:  # the function could not score this completion
            return Reward(total=0.0, components={"reward": 0.0}, counts={"unscored": 1})
        return Reward(total=float(value), components={"reward": float(value)})

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        """The fraction of completions the function scored (a None or a raise is not scored)."""
        scored = 0
        for ex, c in zip(examples, completions, strict=True):
            try:
                scored += not self.reward(ex, c).counts
            except Exception:  # noqa: BLE001 - counted in eval/reward_errors by the scoring path
                pass
        return {"scored": scored / max(len(examples), 1)}


REWARD_FUNCTIONS: dict[str, tuple[RewardFn, str]] = {}


def register_reward(name: str, fn: RewardFn | None = None, *, prompts: str):
    """Register `fn(prompt, completion, **meta) -> float | None` as task `name` with its prompts file.
    Usable as a call or as a decorator: `@register_reward("brevity", prompts="p.jsonl")`."""

    def add(f: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = (f, prompts)
        return f

    return add(fn) if fn is not None else add


def build_custom(spec: str, seed: int, prompts: str | None, task_args: dict[str, Any] | None = None) -> Any:
    """A task from `module:Name`/`file.py:Name` (class or function; a class gets `task_args` as keywords)
    or a registered reward function."""
    obj = REWARD_FUNCTIONS[spec][0] if spec in REWARD_FUNCTIONS else load_object(spec)
    if inspect.isclass(obj):
        return construct(spec, obj, {"seed": seed} | dict(task_args or {}))
    if task_args:
        raise ConfigError(f"task={spec!r} is a reward function: task_args go to a task class's constructor; "
                          "give a function its values through the prompts' fields (its **meta)")
    if spec in REWARD_FUNCTIONS:
        return FunctionTask(obj, read_prompts(prompts or REWARD_FUNCTIONS[spec][1], spec), seed)
    if callable(obj):
        return FunctionTask(obj, read_prompts(prompts, spec), seed)
    raise ConfigError(f"task={spec!r}: {type(obj).__name__} is neither a task class nor a reward function")
