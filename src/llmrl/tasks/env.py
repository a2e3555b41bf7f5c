"""Multi-turn environments: a task whose episodes take several replies, with tools.

    env.reset(example)            -> the first messages (default: example.messages)
    env.step(episode, reply_text) -> Turn(messages to append, or None: the episode is over; reward parts)
    env.reward(episode)           -> Reward of the whole episode (its parts plus the final score)
    env.finish(episode)           -> release what the episode held (called for every episode, whatever happened)

An `Episode` is llmrl's record of one trajectory (the transcript with roles, the turns' reward parts,
tool calls, why it ended); the environment reads it and keeps its own state in `episode.state`
(whatever `reset` put there). Tools are plain Python functions the environment exposes in `tools`; a
call is `<name>argument</name>` in a reply (`find_tool_call`), its result goes back as a message.
The token ids of the trajectory are the rollout's business (rollout/episodes.py), never the
environment's: it sees texts only.

`step` runs in a step worker (tasks/workers.py, config env_isolation): by default in another process,
on a copy of the environment, with the episode sent along; what comes back is the Turn and
`episode.state`, so a step keeps what it learns there (not on `self`, not elsewhere on the episode). A
step that raises, overruns env_timeout or returns anything but a Turn of messages ends its episode with
reward 0 (counted), as does a `reset` that does not return messages. Calls into user code that run in the
trainer (a TRL reward function, an environment_factory's reset and get_reward, `finish`, an OpenEnv reset, a user's
environment's reset, start, reward, evaluate and correct: tasks/custom.py UserCode) are bounded by
user_code_timeout the same way (tasks/workers.py: UserCalls).

Every call the trainer makes into an environment or task (reset, start, step on threads, reward,
finish, evaluate, sample_train_batch) keeps Python's, NumPy's and torch's global RNG states (rng.py):
libraries that reseed them (TextArena, GEM) cannot move the trainer's streams. A task class gets the
config's `task_args` as keywords beside `seed`.

How it maps onto other tools' environments: TRL's `environment_factory` builds one environment per
rollout whose tool methods answer each reply, as `step` does here, and whose `reset(**row)` gives the
first message, as `reset` does. verifiers (v1) scores a taskset with weighted `@vf.reward` methods:
they are a Reward's components, their weighted sum its total (`--task verifiers:ID`, tasks/libraries.py;
its harnesses, agent programs that call the model over HTTP, are not mapped).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmrl.rng import kept_rng_state
from llmrl.tasks.base import Example, Reward


@dataclass
class Turn:
    """An environment's answer to one reply."""

    messages: list[dict[str, str]] | None  # appended to the conversation; None: the episode is over
    parts: dict[str, float] = field(default_factory=dict)  # reward parts earned by this reply (summed per name)
    tool_calls: int = 0  # tool calls this reply made
    tool_errors: int = 0  # of those, how many failed (bad argument, the tool raised)


@dataclass
class Episode:
    """One trajectory: what the environment and the logs see (texts), never token ids."""

    example: Example
    messages: list[dict[str, str]]  # the whole transcript: first messages, then assistant / environment turns
    state: Any = None  # the environment's own, from reset
    replies: int = 0  # policy turns so far
    parts: dict[str, float] = field(default_factory=dict)  # reward parts summed over turns
    tool_calls: int = 0
    tool_errors: int = 0
    env_tokens: int = 0  # environment-message tokens appended (after the cap)
    env_truncated: int = 0  # environment messages cut or dropped at the per-turn cap (max_env_tokens)
    done: bool = False  # the environment ended it (Turn(None))
    cut: str | None = None  # or a limit did: "max_turns", "episode_tokens", "reply_tokens", "env_error"
    truncated: bool = False  # its last reply was cut by a token cap before its EOS (what overlong_* act on)
    error: str | None = None  # what the environment raised, returned wrongly or "timeout after …", with cut == "env_error"

    first: int = 0  # how many of `messages` came from reset (the prompt)

    @property
    def transcript(self) -> list[dict[str, str]]:
        """The messages after the first ones (what the policy and the environment said)."""
        return self.messages[self.first :]

    @property
    def last_reply(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


class Environment:
    """Base class of multi-turn tasks (subclass it, or give the same methods and `is_environment = True`).

    A subclass sets `name`, `eval_n_default`, `max_turns` (the default cap on replies) and implements
    `sample_train_batch`, `eval_examples`, `step`, `reward`; `reset` and `evaluate` have defaults.
    """

    is_environment = True
    name = "environment"
    eval_n_default = 32
    max_turns = 4
    tools: dict[str, Callable[[str], Any]] = {}
    # a reply cut by a token cap ends its episode; True: `step` still sees it (its parts count; what it
    # returns is not appended), as libraries that score every output (SkyRL-gym, TextArena) expect
    step_cut_replies = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed  # llmrl builds every task as Cls(seed=run seed)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the environment (e.g. its prompt RNG: tasks.base.SeededSampling)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset(self, example: Example) -> list[dict[str, str]]:
        """The first messages of an episode (the default: the example's); may set episode state via
        `start`, which llmrl calls with the Episode right after."""
        return list(example.messages)

    def start(self, episode: Episode) -> None:
        """Set up `episode.state` (called once per episode, after reset)."""

    def step(self, episode: Episode, reply: str) -> Turn:
        raise NotImplementedError

    def reward(self, episode: Episode) -> Reward:
        raise NotImplementedError

    def finish(self, episode: Episode) -> None:
        """The episode is over and scored (or failed): release what `reset`/`start` opened for it (a socket, a
        game). Called once for every episode, in the trainer's process: those an error or a limit cut, those
        of a rollout that failed, and eval's. What it raises is reported and the run goes on."""

    def correct(self, episode: Episode) -> bool | None:
        """Did the episode succeed (pass@k in sampled eval)? None: the environment does not say."""
        return None

    def evaluate(self, episodes: list[Episode]) -> dict[str, float]:
        """Eval metrics (eval/ is added): by default the mean of each reward part, turns and tool use."""
        n = max(len(episodes), 1)
        out: dict[str, float] = {}
        for name in dict.fromkeys(k for ep in episodes for k in ep.parts):
            out[name] = sum(ep.parts.get(name, 0.0) for ep in episodes) / n
        out["turns"] = sum(ep.replies for ep in episodes) / n
        out["tool_calls"] = sum(ep.tool_calls for ep in episodes) / n
        return out


class OnRows:
    """Mixin of an environment that plays the rows of a data task held in `self.data` (a dataset's): its
    examples and the sampling state a checkpoint keeps are the data task's."""

    data: Any

    def sample_train_batch(self, n: int) -> list[Example]:
        return self.data.sample_train_batch(n)

    def eval_examples(self, n: int) -> list[Example]:
        return self.data.eval_examples(n)

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)


class Instances:
    """Per-example instances of a library's environment: the one `reset` built the group's prompt with goes to
    the group's first episode (`take`), the others are made new; `drop` returns those never taken."""

    def __init__(self) -> None:
        self.kept: dict[int, list[Any]] = {}

    def keep(self, example: Example, instance: Any) -> None:
        self.kept.setdefault(id(example), []).append(instance)

    def take(self, example: Example, new: Callable[[], Any]) -> Any:
        kept = self.kept.get(id(example))
        if not kept:
            return new()
        instance = kept.pop()
        if not kept:
            del self.kept[id(example)]
        return instance

    def drop(self, example: Example) -> list[Any]:
        return self.kept.pop(id(example), [])


def prompt_text(example: Example, episode: Episode | None = None) -> str:
    """The prompt a log row shows: the last of the episode's first messages (what reset built), else the
    example's last message ("" when there is none)."""
    messages = episode.messages[: episode.first] if episode is not None else example.messages
    return messages[-1]["content"] if messages else ""


def finish_episodes(env: Any, episodes: list[Episode], where: str) -> None:
    """env.finish(episode) for each episode (environments without a `finish` skip it), with the global RNGs kept,
    each on a thread of the trainer within user_code_timeout (tasks/workers.py: UserCalls.here; an overrunning
    finish is abandoned, like a raise); one warning line for those that raised or overran (the run goes on: a
    cleanup's failure loses no result), unless too many overrunning calls are still running (UserCodeStuck: the
    run stops in one line). An environment without a finish of its own (Environment's does nothing: llmrl's calculator
    and guess) has nothing to call."""
    from llmrl.tasks.workers import UserCodeStuck, user_calls

    finish = getattr(env, "finish", None)
    if finish is None or getattr(finish, "__func__", None) is Environment.finish:
        return
    calls = user_calls(env)
    failed: list[str] = []
    for ep in episodes:
        try:
            with kept_rng_state():
                calls.here("the environment's finish", finish, ep)
        except UserCodeStuck:
            raise
        except Exception as e:  # noqa: BLE001 - a user's cleanup may raise anything
            failed.append(f"{type(e).__name__}: {e}")
    if failed:
        print(f"llmrl: warning: {where}: the environment's finish raised for {len(failed)} of {len(episodes)} "
              f"episodes (first: {failed[0]})"[:400], file=sys.stderr)


def is_environment(task: Any) -> bool:
    return bool(getattr(task, "is_environment", False))


def checked_messages(value: Any, what: str) -> list[dict[str, str]]:
    """`value` if it is a list of chat messages (dicts with text `role` and `content`), else TypeError
    naming `what` returned it (an environment's values are the user's code: they are checked, not trusted)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} returned {type(value).__name__}, not a list of messages")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TypeError(f"{what} returned a message that is not a dict with text role and content: {m!r}"[:300])
    return list(value)


def checked_turn(value: Any) -> Turn:
    """A step's return value as a Turn, or TypeError/ValueError saying what is wrong with it."""
    if not isinstance(value, Turn):
        raise TypeError(f"step returned {type(value).__name__}, not a Turn")
    messages = None if value.messages is None else checked_messages(value.messages, "step")
    if not isinstance(value.parts, dict):
        raise TypeError(f"step returned Turn.parts of type {type(value.parts).__name__}, not a dict")
    parts = {}
    for name, v in value.parts.items():
        if not isinstance(name, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"step returned a reward part that is not a finite number: {name!r}: {v!r}"[:300])
        parts[name] = float(v)
    counts = (value.tool_calls, value.tool_errors)
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise TypeError(f"step returned tool_calls/tool_errors {counts!r}, not counts")
    return Turn(messages, parts, *counts)


def call_step(env: Any, episode: Episode, reply: str) -> Turn:
    """env.step with its return value checked (what a step worker or thread runs)."""
    return checked_turn(env.step(episode, reply))


TOOL_CALL = re.compile(r"<(?P<name>[A-Za-z_][A-Za-z0-9_]*)>(?P<arg>.*?)</(?P=name)>", re.DOTALL)


def find_tool_call(reply: str, tools: dict[str, Callable[[str], Any]]) -> tuple[str, str] | None:
    """The first `<name>argument</name>` in a reply whose name is one of `tools`: (name, argument)."""
    for m in TOOL_CALL.finditer(reply):
        if m.group("name") in tools:
            return m.group("name"), m.group("arg").strip()
    return None


def call_tool(tools: dict[str, Callable[[str], Any]], name: str, argument: str) -> tuple[str, bool]:
    """(result text, ok): the tool's return value as text, or the error it raised (ok False)."""
    try:
        return str(tools[name](argument)), True
    except Exception as e:  # noqa: BLE001 - a tool may fail on any argument the policy writes
        return f"error: {type(e).__name__}: {e}"[:200], False


class OneTurn:
    """A single-turn task as the one-turn case of an environment: its prompt, one reply, over. The
    rollout of every task goes through run_episodes with this; the reply is scored by the task's own
    `reward` on the text (training/step.py), as before there were environments."""

    max_turns = 1

    def __init__(self, task) -> None:
        self.task = task

    def reset(self, example: Example) -> list[dict[str, str]]:
        return example.messages

    def start(self, episode: Episode) -> None:
        pass

    def step(self, episode: Episode, reply: str) -> Turn:
        return Turn(None)
