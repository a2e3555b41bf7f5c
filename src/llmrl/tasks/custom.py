"""User tasks and plain reward functions.

    --task my_pkg.rewards:MyTask          a class with the Task methods, built as MyTask(seed=...)
    --task path/to/rewards.py:MyTask      the same, from a file
    --task path/to/rewards.py:reward --prompts prompts.jsonl
                                          a plain function reward(prompt, completion, **meta) -> float | None

In Python, `register_reward("name", fn, prompts="prompts.jsonl")` (or the decorator form) adds a
function task to the registry so `--task name` finds it. A prompts file has one JSON object per line:
`prompt` (the user message), optional `system`, and any other fields, which reach the reward as `meta`.
Training samples prompts with the run's seed; eval uses the first eval_n prompts in file order.

In a run (make_task given the run's UserCalls, as task_from_config does), each call into this code is bounded by
user_code_timeout (tasks/workers.py): a reward function through UserCalls.call (BoundedFunction: a module-level
function in a worker process, killed at the limit; anything else on a thread), a task or environment instance's
methods on threads of the trainer (UserCode). make_task decides what is the user's: a class or function named by
a spec, a registered reward function, an environment registered with register_env; llmrl's own tasks and the
library adapters are called directly.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import random
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmrl.errors import ConfigError, DataError, EngineDied
from llmrl.tasks.base import Example, Reward, SeededSampling
from llmrl.tasks.env import is_environment
from llmrl.tasks.workers import CallTimeout, UserCalls, tried_at_start, user_calls

RewardFn = Callable[..., "float | None"]

PYTHON_MARK = "<python: "  # how a spec written for a callable that no name imports again starts
PYTHON_OBJECTS: dict[str, Any] = {}  # such spec → the callable given to load_config in this process (python_spec)


def python_spec(obj: Any) -> str:
    """The spec a callable given from Python (load_config's task, reward_funcs, environment_factory) is written as in
    the config and its run directory: `module:name` when that name imports this very object again (a module-level
    function or class of an importable module; `file.py:name` for a file load_object loaded), so a run directory
    resumes with it as with any spec; else a marker `<python: module.qualname>` (a function defined in a notebook or
    `__main__`, a closure, a lambda, a callable object), held for this process in PYTHON_OBJECTS: another process
    must be given the callable again (python_object). A later callable with the same marker (a notebook cell run
    again) replaces the earlier."""
    module_name = getattr(obj, "__module__", None) or ""
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = sys.modules.get(module_name)
    named = module is not None and qualname.isidentifier() and getattr(module, qualname, None) is obj
    if named and module_name != "__main__":
        file = getattr(module, "__file__", None)
        if module_name.startswith("_llmrl_task_") and file:
            return f"{file}:{qualname}"
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.name == module_name and not module_name.startswith("_llmrl_task_"):
            return f"{module_name}:{qualname}"
    marker = f"{PYTHON_MARK}{module_name}.{qualname}>"
    PYTHON_OBJECTS[marker] = obj
    return marker


def is_python_marker(spec: str) -> bool:
    """`spec` is python_spec's marker for a callable no name imports (held by this process or not)."""
    return spec.startswith(PYTHON_MARK) and spec.endswith(">")


def marker_name(spec: str) -> str:
    """The callable's own name in a marker: `<python: __main__.correct>` → correct."""
    return spec[len(PYTHON_MARK):-1].rpartition(".")[2] or spec


def python_object(spec: str, field: str = "task", config: str = "CONFIG") -> Any:
    """The callable a marker stands for, or one ConfigError line saying it must be given again (a run directory's
    config read by another process: the file holds its name, not its code); `config` names the file in that line."""
    if spec in PYTHON_OBJECTS:
        return PYTHON_OBJECTS[spec]
    raise ConfigError(f"{field}: {spec} names a Python object given to llmrl.load_config, which a config file "
                      f"cannot hold: give it again, e.g. llmrl.load_config({config!r}, "
                      f"{{{field!r}: {'[' if field == 'reward_funcs' else ''}{marker_name(spec)}"
                      f"{', ...]' if field == 'reward_funcs' else ''}}})")


def load_object(spec: str) -> Any:
    """The object named by `module.path:Name` or `file.py:Name`, or by python_spec's marker (python_object)."""
    if is_python_marker(spec):
        return python_object(spec)
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
            except EngineDied:  # too many overrunning calls still running: the run stops
                raise
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


def build_custom(spec: str, seed: int, prompts: str | None, task_args: dict[str, Any] | None = None,
                 calls: UserCalls | None = None) -> Any:
    """A task from `module:Name`/`file.py:Name` (class or function; a class gets `task_args` as keywords)
    or a registered reward function: the user's code, bounded by `calls` when given (a run's: user_object,
    user_function)."""
    obj = REWARD_FUNCTIONS[spec][0] if spec in REWARD_FUNCTIONS else load_object(spec)
    if inspect.isclass(obj):
        return user_object(construct(spec, obj, {"seed": seed} | dict(task_args or {})), spec, calls)
    if task_args:
        raise ConfigError(f"task={spec!r} is a reward function: task_args go to a task class's constructor; "
                          "give a function its values through the prompts' fields (its **meta)")
    if not callable(obj):
        raise ConfigError(f"task={spec!r}: {type(obj).__name__} is neither a task class nor a reward function")
    rows = read_prompts(prompts or REWARD_FUNCTIONS[spec][1] if spec in REWARD_FUNCTIONS else prompts, spec)
    task = FunctionTask(user_function(obj, spec, calls), rows, seed)
    check_plain_function(obj, spec, task, calls is not None)
    return task


def check_plain_function(fn: Callable, spec: str, task: FunctionTask, call: bool) -> None:
    """A plain reward function tried at start on the first prompt, so that one that cannot work stops the run in one
    ConfigError line: its signature must take what FunctionTask.reward gives it (the prompt, the completion, the
    prompts file's other fields as keywords), read without calling it; then, with `call` (in a run: the call bounded
    by user_code_timeout), a call on an empty completion must return a number or None, not raise. One that overruns
    is one warning line."""
    from llmrl.tasks.dataset import called_as, is_score

    example = FunctionTask.example(task.prompts[0])
    shown = called_as(getattr(fn, "__name__", None) or spec, fn)
    trl = "; a TRL-signature f(prompts, completions, **columns) goes in reward_funcs, with a dataset"
    try:
        inspect.signature(fn).bind(example.messages[-1]["content"], "", **example.meta)
    except TypeError as e:
        raise ConfigError(f"task={spec!r}: {shown} must take (prompt, completion, **fields), as a plain reward "
                          f"function is called (here with the fields {', '.join(example.meta) or 'none'}): {e}{trl}") from None
    except ValueError:  # no signature to read (a builtin): its call says
        pass
    if not call:
        return
    ran, value = tried_at_start(lambda: task.fn(example.messages[-1]["content"], "", **example.meta),
                                f"task={spec!r}: {shown}", "an empty completion of the first prompt", "completion")
    if not ran:
        return
    if not is_score(value):
        raise ConfigError(f"task={spec!r}: {shown} returned {repr(value)[:60]} (a {type(value).__name__}) for one "
                          f"completion; a plain reward function returns a float or None{trl}")


# ----------------------------------------------------------------------------- the user's code in a run


def user_object(obj: Any, spec: str, calls: UserCalls | None) -> Any:
    """A user's task or environment instance as a run holds it: `calls` None (make_task outside a run): itself;
    else UserCode, its calls bounded by `calls`."""
    return obj if calls is None else UserCode(obj, spec, calls)


def user_function(fn: Callable, spec: str, calls: UserCalls | None) -> Callable:
    """A user's reward function as a FunctionTask calls it: `calls` None: itself; else BoundedFunction."""
    return fn if calls is None else BoundedFunction(fn, f"reward function {spec}", calls)


class UserCodeOverran(EngineDied):
    """A call into a user's task or environment overran user_code_timeout where nothing can stand in for what it
    returns (the prompts it draws, an eval verdict): the loop saves the last step learned and stops in one line."""


class Overruns:
    """Calls that overran, by the identity of their arguments (the last 1024): the same call again (scoring asks one
    completion at a time after a batch's call fails; a task's evaluate scores again what was scored) raises the same
    CallTimeout at once instead of costing another limit."""

    def __init__(self) -> None:
        self.seen: deque[tuple[tuple, str]] = deque(maxlen=1024)

    def add(self, args: tuple, why: str) -> None:
        self.seen.append((args, why))

    def check(self, args: tuple) -> None:
        for seen, why in self.seen:
            if len(seen) == len(args) and all(a is b for a, b in zip(seen, args)):
                raise CallTimeout(why)


SIGNAL_REFUSED = "signal only works in main thread"  # what Python's signal module raises on another thread


def signal_refused(e: BaseException | None) -> bool:
    """`e`, or an exception it was raised from, is the signal module's refusal to set a handler off the main thread."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ValueError) and SIGNAL_REFUSED in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


class MainThreadOnly:
    """The calls that set signal handlers (math-verify's parse and verify do, for their own timeouts), which Python
    allows on the main thread only: on a thread they raise ValueError, so such a call is made again on the calling
    thread (when that is the main thread), and that call's later ones stay there, without user_code_timeout (one
    warning line says so)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def refused(self, name: str, what: str, e: BaseException) -> bool:
        """True when `e` (or what it was raised from) is the signal module's refusal and the caller is the main
        thread: `name` runs there from now on."""
        if threading.current_thread() is not threading.main_thread() or not signal_refused(e):
            return False
        self.names.add(name)
        print(f"llmrl: warning: {what} sets signal handlers (math-verify's timeouts do), which only the main thread "
              "may: it runs there from now on, without user_code_timeout (math-verify: pass parsing_timeout=None and "
              "timeout_seconds=None to keep the limit)", file=sys.stderr)
        return True


class BoundedFunction:
    """A user's plain reward function, each call through `calls.call` (tasks/workers.py: a module-level function in
    a worker process, killed at user_code_timeout; anything else on a thread, abandoned there): an overrun raises
    CallTimeout, which scoring counts (the completion scores 0: reward/errors, reward/timeouts)."""

    def __init__(self, fn: Callable, what: str, calls: UserCalls) -> None:
        self.fn, self.what, self.calls, self.overruns = fn, what, calls, Overruns()
        self.main_only = MainThreadOnly()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.overruns.check(args)
        if self.main_only.names:
            return self.fn(*args, **kwargs)
        try:
            return self.calls.call(self.what, self.fn, *args, **kwargs)
        except CallTimeout as e:
            self.overruns.add(args, str(e))
            raise
        except Exception as e:
            if not self.main_only.refused("call", self.what, e):
                raise
        return self.fn(*args, **kwargs)


COUNTED = ("reward", "reward_batch", "reset", "start", "evaluate")  # an overrun raises CallTimeout, which is counted
STOPPING = ("sample_train_batch", "eval_examples", "judge", "correct")  # an overrun stops the run (UserCodeOverran)


class UserCode:
    """A user's task or environment instance (a class named by `--task file.py:Name` or `module:Name`, or registered
    with register_env) as a run holds it: what llmrl reads on it is the instance's, and these calls run on a daemon
    thread of the trainer within user_code_timeout (UserCalls.here: abandoned at the limit; more than 4 still
    running stop the run in one line, UserCodeStuck). An overrun of

        reward, reward_batch    raises CallTimeout: the completion or episode scores 0, counted in reward/errors and
                                reward/timeouts (tasks/score.py; a batch's completions are not asked again one by one)
        reset, start            raises CallTimeout: the group's (the episode's) episodes end before their first reply,
                                counted in rollout/env_errors and rollout/env_timeouts (rollout/episodes.py)
        evaluate                raises CallTimeout: the eval says so in one warning line and logs eval/reward
        sample_train_batch, eval_examples, judge, correct
                                stops the run (UserCodeOverran: the last step learned is saved, one line)

    step has its own limit (env_timeout; tasks/workers.py), and a step worker process gets the instance itself
    (pickling this pickles the instance); finish_episodes bounds `finish` (tasks/env.py). Attributes set on this are
    set on the instance, except `user_calls` (task_from_config's)."""

    def __init__(self, inner: Any, spec: str, calls: UserCalls) -> None:
        object.__setattr__(self, "_user_inner", inner)
        object.__setattr__(self, "_user_what", f"{'environment' if is_environment(inner) else 'task'} {spec}")
        object.__setattr__(self, "_user_overruns", Overruns())  # reward calls that overran
        object.__setattr__(self, "_user_main_only", MainThreadOnly())  # methods that set signal handlers
        object.__setattr__(self, "user_calls", calls)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_user_"):  # not set yet (a copy being built)
            raise AttributeError(name)
        value = getattr(self._user_inner, name)
        if (name in COUNTED or name in STOPPING) and callable(value):
            return functools.partial(self._user_call, name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "user_calls":
            object.__setattr__(self, name, value)
        else:
            setattr(self._user_inner, name, value)

    def __reduce__(self) -> tuple:
        return _itself, (self._user_inner,)

    def __repr__(self) -> str:
        return repr(self._user_inner)

    @property
    def worker_classes(self) -> list[type]:
        """The classes a step worker process imports (tasks/workers.py): the instance's and those it names."""
        return [type(self._user_inner), *getattr(self._user_inner, "worker_classes", ())]

    def _user_call(self, name: str, method: Callable, *args: Any, **kwargs: Any) -> Any:
        what = f"{self._user_what}: {name}"
        if name == "reward":
            self._user_overruns.check(args)
        if name in self._user_main_only.names:
            return method(*args, **kwargs)
        calls = user_calls(self)
        try:
            return calls.here(what, method, *args, **kwargs)
        except CallTimeout as e:
            if name in STOPPING:
                raise UserCodeOverran(f"{what} did not return within user_code_timeout={calls.timeout:g} s (abandoned "
                                      "on its thread) and nothing can stand in for what it returns: fix it, or raise "
                                      "user_code_timeout") from None
            if name == "reward":
                self._user_overruns.add(args, str(e))
            elif name == "reward_batch" and len(args) >= 2:
                for pair in zip(args[0], args[1]):
                    self._user_overruns.add(pair, str(e))
            raise
        except Exception as e:
            if not self._user_main_only.refused(name, what, e):
                raise
        return method(*args, **kwargs)


def _itself(obj: Any) -> Any:
    return obj
