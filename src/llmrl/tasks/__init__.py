"""Task registry: `--task NAME` picks a class from `TASKS` (or a function registered with
`register_reward`); `--task package.module:Name` or `--task file.py:Name` loads a user task class
(constructed as `Name(seed=...)`) or a plain reward function (with `--prompts`); see tasks/custom.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrl.errors import ConfigError, DataError, UserError
from llmrl.tasks.base import Example, Reward, Task
from llmrl.tasks.calculator import CalculatorEnv
from llmrl.tasks.custom import (REWARD_FUNCTIONS, FunctionTask, build_custom, construct, is_python_marker, marker_name,
                                python_object, register_reward, user_object)
from llmrl.tasks.dataset import DatasetTask
from llmrl.tasks.env import Environment, Episode, Turn, is_environment
from llmrl.tasks.format_copy import FormatCopyTask
from llmrl.tasks.guess import GuessEnv
from llmrl.tasks.libraries import is_library_task, library_task
from llmrl.tasks.math_hard import MathHardTask
from llmrl.tasks.mixture import MixtureTask, mixture_parts

TASKS: dict[str, type] = {
    "format_copy": FormatCopyTask,
    "math_hard": MathHardTask,
    "calculator": CalculatorEnv,
    "guess": GuessEnv,
    "dataset": DatasetTask,
}
BUILT_IN = dict(TASKS)  # llmrl's own: called directly; a class register_env adds (or puts in their place) is the user's


def register_env(name: str, cls: type | None = None):
    """Register an environment class (tasks/env.py: Environment) as task `name`, built as cls(seed=...).
    Usable as a call or as a class decorator: `@register_env("maze")`."""

    def add(c: type) -> type:
        if not getattr(c, "is_environment", False):
            raise TypeError(f"register_env({name!r}): {c.__name__} is not an Environment (subclass llmrl.Environment)")
        TASKS[name] = c
        return c

    return add(cls) if cls is not None else add


def make_task(name: str, seed: int, math_data: str | None = None, prompts: str | None = None,
              task_args: dict[str, Any] | None = None, calls: Any = None, **math_options) -> Task:
    """Build a task by name; its RNG is seeded from the run's seed. `math_options` (reward,
    time_limit, workers) go to math_hard; `task_args` to the task's constructor (a class task or
    environment, built-in or the user's), as keywords beside `seed`. With `calls` (a run's UserCalls:
    task_from_config), the user's code is bounded by its limit: this is where what is the user's is decided (a
    spec's class or function, a registered reward function, a register_env class: tasks/custom.py user_object,
    user_function); llmrl's own tasks and the library adapters are called directly."""
    args = dict(task_args or {})
    parts = mixture_parts(name, is_single_task_name)
    if parts is not None:  # a, b: a weighted mixture; task_args holds each task's own and the weights
        unknown = set(args) - set(parts) - {"weights"}
        if unknown:
            raise ConfigError(f"task={name!r}: task_args of a mixture are one mapping per task and weights; "
                              f"{sorted(unknown)} is neither")
        tasks = {p: make_task(p, seed, math_data, prompts, args.get(p), calls, **math_options) for p in parts}
        return MixtureTask(seed, tasks, args.get("weights"))
    if name == "math_hard":
        return construct(name, MathHardTask, dict(seed=seed, data=math_data, **math_options) | args)
    if name in TASKS:
        task = construct(name, TASKS[name], dict(seed=seed) | args)
        return task if TASKS[name] is BUILT_IN.get(name) else user_object(task, name, calls)
    if is_library_task(name):
        return library_task(name, seed, args)
    return build_custom(name, seed, prompts, args, calls)


def task_from_config(cfg) -> Task:
    """The task a TrainConfig asks for, seeded by cfg.seed (every rank draws the same prompts), its calls into user
    code bounded by cfg.user_code_timeout (tasks/workers.py: UserCalls)."""
    from llmrl.tasks.workers import UserCalls

    calls = UserCalls(cfg.user_code_timeout, cfg.env_isolation, cfg.env_timeout)
    check_python_objects(cfg, str(Path(cfg.output_dir) / "config.yaml"))  # where a config holding one comes from
    task = _task_from_config(cfg, calls)
    give_user_calls(task, calls)
    data = task if isinstance(task, DatasetTask) else getattr(task, "data", None)
    if isinstance(data, DatasetTask):  # its reward functions tried on one row, within the run's limit
        data.check_functions(environments=data is not task)
    return task


def python_markers(cfg) -> list[tuple[str, str]]:
    """(field, spec) of each callable a config was given from Python that no name imports (tasks/custom.py:
    python_spec's markers)."""
    named = [("task", cfg.task), *(("reward_funcs", s) for s in getattr(cfg, "reward_funcs", ())),
             ("environment_factory", getattr(cfg, "environment_factory", None))]
    return [(field, spec) for field, spec in named if spec and is_python_marker(spec)]


def check_python_objects(cfg, config: str) -> None:
    """One ConfigError line when the config names a callable given from Python in another process (its run
    directory's config.yaml read again): it must be given again (tasks/custom.py: python_object)."""
    for field, spec in python_markers(cfg):
        python_object(spec, field, config)


def give_user_calls(task: Any, calls: Any) -> None:
    """Set `user_calls` on a task, the data task it plays (`data`) and a mixture's tasks."""
    seen: set[int] = set()
    todo = [task]
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        try:
            t.user_calls = calls
        except AttributeError:  # a class with __slots__ or a read-only attribute: it keeps the defaults
            pass
        parts = getattr(t, "tasks", None)  # a mixture's {name: task}
        todo += [getattr(t, "data", None), *(parts.values() if isinstance(parts, dict) else ())]


def _task_from_config(cfg, calls: Any) -> Task:
    if cfg.task == "dataset" or (cfg.dataset and is_library_task(cfg.task)):
        system = cfg.system_prompt.strip()
        system = None if system == "auto" else "" if system.lower() in ("", "none") else cfg.system_prompt
        options = dict(source=cfg.dataset, config=cfg.dataset_config, split=cfg.dataset_split, eval_split=cfg.eval_split,
                       eval_holdout=cfg.eval_holdout, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                       system_prompt=system, grader=cfg.grader, reward_funcs=cfg.reward_funcs,
                       reward_weights=[float(w) for w in cfg.reward_weights], time_limit=cfg.grade_time_limit,
                       workers=cfg.grade_workers, batch_size=cfg.batch_size)
        if cfg.environment_factory:
            return factory_environment(cfg, options, calls)
        if cfg.task != "dataset":  # a library environment on the dataset's rows (skyrl_gym:ENV)
            data = construct("dataset", DatasetTask, dict(seed=cfg.seed) | options | {
                "needs_answer": False, "system_prompt": options["system_prompt"] or ""})
            return library_task(cfg.task, cfg.seed, {"data": data} | dict(cfg.task_args))
        return construct("dataset", DatasetTask, dict(seed=cfg.seed) | options | dict(cfg.task_args))
    return make_task(cfg.task, seed=cfg.seed, math_data=cfg.math_data, prompts=cfg.prompts, task_args=cfg.task_args,
                     calls=calls, reward=cfg.math_reward, time_limit=cfg.grade_time_limit, workers=cfg.grade_workers)


def factory_environment(cfg, options: dict[str, Any], calls: Any = None) -> Environment:
    """A TRL environment_factory class on the dataset's rows (tasks/tools.py); its rows keep their fields for
    reset(**row); the grader's gold answers and system prompt only when nothing else scores (reward_funcs, or
    the class's get_reward). `calls` bound its calls into the class (the instance built at start-up too)."""
    from llmrl.tasks.custom import load_object
    from llmrl.tasks.tools import FactoryEnvironment

    spec = cfg.environment_factory
    factory = python_object(spec, "environment_factory") if is_python_marker(spec) else load_object(spec)
    if not callable(factory):
        raise ConfigError(f"environment_factory={cfg.environment_factory!r} is not a class")
    graded = not cfg.reward_funcs and not callable(getattr(factory, "get_reward", None))
    if not graded and cfg.system_prompt.strip() == "auto":
        options = options | {"system_prompt": ""}
    try:
        data = construct("dataset", DatasetTask, dict(seed=cfg.seed) | options | {"needs_answer": graded})
    except DataError as e:
        if not graded or "answer column" not in str(e):
            raise
        raise ConfigError(f"environment_factory={cfg.environment_factory!r}: nothing scores an episode: give "
                          f"--reward_funcs, a get_reward method, or a dataset answer column for the grader ({e})") from None
    return construct(cfg.environment_factory, FactoryEnvironment,
                     dict(factory=factory, data=data, spec=cfg.environment_factory, seed=cfg.seed, user_calls=calls)
                     | dict(cfg.task_args))


def is_task_name(name: str) -> bool:
    """A registered name, an existing `file.py:Name`, something shaped like `package.module:Name`, or a
    comma-separated mixture of these (tasks/mixture.py)."""
    return is_single_task_name(name) or mixture_parts(name, is_single_task_name) is not None


def is_single_task_name(name: str) -> bool:
    module, sep, attr = name.rpartition(":")
    if name in TASKS or name in REWARD_FUNCTIONS or is_library_task(name) or is_python_marker(name):
        return True
    if module.endswith(".py"):
        return Path(module).is_file() and attr.isidentifier()
    return bool(sep and module and attr.isidentifier())


def is_task_code(task: str) -> bool:
    """A `file.py:Name` or `module:Name` spec that is not a registered name, or a library task naming a server's URL
    (`openenv:http://HOST:PORT`), or a mixture holding one: loading it runs code, or contacts a host that then
    chooses the rewards."""
    parts = mixture_parts(task, is_single_task_name)
    if parts is not None:
        return any(is_task_code(p) for p in parts)
    if is_library_task(task):
        return names_server(task)
    module, sep, _ = task.rpartition(":")
    return bool(sep and module) and task not in TASKS and task not in REWARD_FUNCTIONS


def names_server(task: str) -> bool:
    """A library task whose name is a URL (openenv:URL): llmrl would contact that host."""
    return is_library_task(task) and "://" in task.partition(":")[2]


OWN_REWARDS = "llmrl.rewards:"  # how a spec of one of llmrl's own reward functions starts


def code_specs(task: str, reward_funcs: list[str] | tuple[str, ...] = (), environment_factory: str | None = None) -> list[str]:
    """The code a config names: its task when that is code, its reward functions (but llmrl's own, llmrl.rewards:NAME,
    which are as much llmrl's as its built-in tasks) and its environment_factory."""
    return ([task] if is_task_code(task) else []) + [f for f in reward_funcs if not f.startswith(OWN_REWARDS)] + (
        [environment_factory] if environment_factory else [])


def config_code(cfg) -> list[str]:
    """code_specs of a TrainConfig."""
    return code_specs(cfg.task, getattr(cfg, "reward_funcs", ()), getattr(cfg, "environment_factory", None))


def resume_command(cfg, run_dir: Path | str) -> str:
    """The command a stop line tells the user to resume with (with --trust_task_code when the config names code:
    the run is the user's own)."""
    from llmrl.config import launch_flags

    given = python_markers(cfg)
    if given:  # callables given from Python: resumed from Python, with them given again
        values = {field: marker_name(spec) for field, spec in given}
        if "reward_funcs" in values:
            values["reward_funcs"] = "[" + ", ".join(marker_name(s) if is_python_marker(s) else repr(s)
                                                     for s in cfg.reward_funcs) + "]"
        shown = ", ".join(f"{field!r}: {value}" for field, value in values.items())
        return f"llmrl.train(llmrl.load_config('{Path(run_dir) / 'config.yaml'}', {{{shown}}}), resume=True)"
    runs_code = config_code(cfg)
    return f"llmrl train --resume {run_dir}" + launch_flags() + (" --trust_task_code" if runs_code else "")


def check_task_code(cfg, run_dir: Path | str, trusted: bool) -> None:
    """Refuse to import the task code that a run directory names, unless `trusted` (--trust_task_code, or
    the code named again on the command line): every command that loads a run directory or one of its
    checkpoints (`eval --run/--adapter`, `export --merge`, `chat`, `train --resume`) calls this before
    building the task.

    What a run directory holds is data, except its task and its reward functions. config.yaml's values, the
    checkpoint (safetensors weights; optimizer and RNG state loaded with `weights_only=True`, so nothing is
    unpickled into code; JSON trainer state), the `prompts` file, `math_data` and `dataset` (rows) are only
    read, and the base model is loaded without `trust_remote_code`. Code is a `task` that is not a registered
    name, and each of `reward_funcs`: `file.py:Name` executes that file and `package.module:Name` imports that
    module, then constructs the class or calls the function on every completion; a library task naming a URL
    (`openenv:http://HOST:PORT`) is treated the same way: llmrl would contact that host, and its answers become the
    rewards. `llmrl train --config FILE`
    runs the code its own config names (the user chose that file); a run directory someone hands you does not
    run code without --trust_task_code, as a Hugging Face model does not without trust_remote_code. A callable
    given from Python (tasks/custom.py: python_spec's marker) is not in the file: one line says to give it again,
    and given again in this process it is the user's own."""
    check_python_objects(cfg, str(Path(run_dir) / "config.yaml"))
    code = [spec for spec in config_code(cfg) if not is_python_marker(spec)]
    if trusted or not code:
        return
    parts = mixture_parts(cfg.task, is_single_task_name) or [cfg.task]
    if code[0] == cfg.task and all(names_server(p) or not is_task_code(p) for p in parts):
        raise UserError(f"run dir {run_dir} names task {code[0]!r} (a server it would contact, which then chooses the "
                        "rewards); pass --trust_task_code to contact it, or name it again with --task")
    kind = "a file" if code[0].rpartition(":")[0].endswith(".py") else "a module"
    what, option = (("task code", "--task") if code[0] == cfg.task else
                    ("environment_factory", "--environment_factory") if code[0] == getattr(cfg, "environment_factory", None)
                    else ("reward function", "--reward_funcs"))
    raise UserError(f"run dir {run_dir} names {what} {code[0]!r} ({kind} it would import); pass --trust_task_code "
                    f"to run it, or name it again with {option}")


__all__ = ["TASKS", "check_task_code", "code_specs", "config_code", "is_task_code", "resume_command", "register_env", "Environment", "Episode", "Turn", "is_environment", "Example", "FunctionTask", "is_task_name", "Reward", "Task", "make_task", "register_reward",
           "task_from_config"]
