"""Tools the chat-template way, and TRL's `environment_factory` classes run unchanged.

    schemas = [tool_schema(f) for f in functions]       JSON schemas from type hints and the docstring
    calls = parse_tool_calls(reply, names)              [ToolCall(name, arguments or None, error)]
    text, ok = run_tool(fn, call)                        the result as text, or the error (ok False)

A tool is a typed, docstring'd function or method (transformers' `get_json_schema` reads it). The schemas
reach the model through the chat template (`apply_chat_template(..., tools=schemas)`); the environment's
answer to a reply with calls is one `role: "tool"` message per call, which the template frames and the rows
mask (environment tokens: mask 0). A call is written either the Hermes/Qwen way, a JSON object with `name`
and `arguments` inside `<tool_call>…</tool_call>` (several per reply allowed), or in llmrl's tag form
`<name>argument</name>`, whose text goes to the tool's first parameter (converted to an int, float or bool
when that parameter says so).

`FactoryEnvironment` runs a TRL `environment_factory` class (`--environment_factory file.py:Cls`): one
instance per episode, built with no arguments, `reset(**row)` with the dataset row's fields (a text it
returns is appended to the prompt's last message after a blank line), every public method but `reset` and
`get_reward` a tool. A reply without a tool call ends the episode (as TRL's tool loop does; so does
max_turns). The reward: the run's `--reward_funcs` (TRL's signature; `environments=[the episode's
instance]` is passed beside the columns, the completion is the episode's messages after the prompt), else
the instance's `get_reward()`, else the dataset's grader on the last reply. The instance lives in
`episode.state`: with env_isolation process it is pickled to the step worker and back each turn, so it
must be picklable (a live client or socket: env_isolation thread). Building and resetting an instance, and
get_reward, are bounded by user_code_timeout (tasks/workers.py: UserCalls; with env_isolation process they run
in a worker process too, killed at the limit, and the reset instance comes back pickled): a reset that overruns
ends its group's episodes before their first reply (rollout/env_errors and rollout/env_timeouts, reward 0), a
get_reward that overruns scores its episode 0 (reward/errors).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmrl.errors import ConfigError, EngineDied
from llmrl.tasks.base import Example, Reward
from llmrl.tasks.env import Environment, Episode, Instances, OnRows, Turn
from llmrl.tasks.workers import CallTimeout, user_calls

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TAG_CALL = re.compile(r"<(?P<name>[A-Za-z_][A-Za-z0-9_]*)>(?P<arg>.*?)</(?P=name)>", re.DOTALL)
RESULT_CHARS = 2000  # a tool result is cut here before the token cap (max_env_tokens) applies


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | str | None  # JSON object, a tag's text, or None when unreadable
    error: str | None = None  # why the call cannot be made (bad JSON, no such tool)


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The JSON schema of a typed, docstring'd function or method (transformers' get_json_schema), or a
    ConfigError line naming the tool and what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises its own errors for a missing hint or docstring
        raise ConfigError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema: {e} (a tool needs type hints "
                          "and a docstring with an Args: section)") from None


def parse_tool_calls(reply: str, names: set[str] | list[str]) -> list[ToolCall]:
    """The tool calls in a reply, in order: every `<tool_call>{json}</tool_call>`, or when there is none, every
    `<name>argument</name>` whose name is a tool. A call block that is not a JSON object with a text `name` is
    a call with an error (counted as a tool error), as is a call of a name that is no tool."""
    blocks = HERMES_CALL.findall(reply)
    if not blocks:
        return [ToolCall(m["name"], m["arg"].strip()) for m in TAG_CALL.finditer(reply) if m["name"] in names]
    calls = []
    for block in blocks:
        try:
            value = json.loads(block)
        except ValueError as e:
            calls.append(ToolCall("?", None, f"the tool call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall("?", None, "the tool call is not a JSON object with a \"name\""))
            continue
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(value["name"], None, "the tool call's arguments are not a JSON object"))
        elif value["name"] not in names:
            calls.append(ToolCall(value["name"], None, f"there is no tool {value['name']!r}"))
        else:
            calls.append(ToolCall(value["name"], args))
    return calls


def _converted(text: str, annotation: Any) -> Any:
    if annotation is bool:
        return {"true": True, "false": False}.get(text.lower(), text)
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            return text
    return text


def run_tool(fn: Callable | None, call: ToolCall) -> tuple[str, bool]:
    """(result text, ok): the tool's return value (a str as it is, anything else as JSON when it can be), or
    `error: …` when the call is unreadable, its arguments do not fit the signature, or the tool raised."""
    if call.error is not None:
        return f"error: {call.error}", False
    try:
        if isinstance(call.arguments, str):  # the tag form: the text is the first parameter
            params = list(inspect.signature(fn).parameters.values())
            if not params:
                raise TypeError(f"{call.name} takes no argument")
            value = fn(**{params[0].name: _converted(call.arguments, params[0].annotation)})
        else:
            value = fn(**(call.arguments or {}))
    except Exception as e:  # noqa: BLE001 - a tool may fail on anything the policy writes
        return f"error: {type(e).__name__}: {e}"[:RESULT_CHARS], False
    if not isinstance(value, str):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
    return value[:RESULT_CHARS], True


def public_methods(instance: Any) -> dict[str, Callable]:
    """An environment_factory instance's tools: its public methods but reset and get_reward (TRL's rule)."""
    return {name: m for name, m in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in ("reset", "get_reward")}


def fresh_reset(factory: Callable[[], Any], row: dict[str, Any]) -> tuple[Any, Any]:
    """(what reset returned, the instance): a new instance of an environment_factory class, reset with the row's
    fields. Run through UserCalls: in a worker process (the instance comes back pickled, as a step's does), or on a
    thread, killed or abandoned at user_code_timeout."""
    instance = factory()
    return instance.reset(**accepted(instance.reset, row)), instance


def instance_reward(instance: Any) -> float:
    """An environment_factory instance's get_reward(), as a float (run through UserCalls, as fresh_reset)."""
    return float(instance.get_reward())


def joined(prompt: str, text: str) -> str:
    """`text` (what an environment_factory's reset returned) after `prompt`, a blank line between them unless
    either side already has whitespace there: "Solve it." + "Board: ..." -> "Solve it.\n\nBoard: ..."."""
    if not prompt or not text or prompt[-1].isspace() or text[0].isspace():
        return prompt + text
    return f"{prompt}\n\n{text}"


def accepted(fn: Callable, row: dict[str, Any]) -> dict[str, Any]:
    """The fields of `row` that `fn` takes as keywords (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(row)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in row.items() if k in names}


class FactoryEnvironment(OnRows, Environment):
    """A TRL environment_factory class as an llmrl environment, on the rows of a dataset task."""

    name = "environment_factory"
    max_turns = 4

    def __init__(self, factory: Callable[[], Any], data, spec: str, seed: int = 0, user_calls: Any = None) -> None:
        super().__init__(seed)
        self.factory, self.data, self.spec = factory, data, spec
        if user_calls is not None:  # the run's limit (task_from_config), for the instance built here too
            self.user_calls = user_calls
        self.worker_classes = [factory] if isinstance(factory, type) else []  # step workers import its module
        probe = self.new_instance()
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"environment_factory={spec!r}: the class has no reset method")
        tools = public_methods(probe)
        if not tools:
            raise ConfigError(f"environment_factory={spec!r}: the class has no public method to use as a tool")
        self.tool_names = sorted(tools)
        self.tool_schemas = [tool_schema(tools[name]) for name in self.tool_names]
        self.funcs = getattr(data, "funcs", [])
        self.scored_by = ("reward_funcs" if self.funcs else "get_reward" if callable(getattr(probe, "get_reward", None))
                          else "grader" if getattr(data, "answer_field", None) else None)
        if self.scored_by is None:
            raise ConfigError(f"environment_factory={spec!r}: nothing scores an episode: give --reward_funcs, a "
                              "get_reward method, or a dataset answer column for the grader")
        if self.scored_by == "reward_funcs":
            data.refuse_columns(("environments",), f"environment_factory={spec!r}")
        self.eval_n_default = getattr(data, "eval_n_default", 32)
        self.instances = Instances()  # the instance reset built a group's prompt with

    def new_instance(self) -> Any:
        """An instance built on a thread of the trainer within user_code_timeout (UserCalls.here): one that raises or
        overruns is one ConfigError line."""
        try:
            return user_calls(self).here(f"environment_factory {self.spec}: building an instance", self.factory)
        except CallTimeout as e:
            raise ConfigError(f"environment_factory={self.spec!r}: building an instance did not end: {e}") from None
        except EngineDied:
            raise
        except Exception as e:  # noqa: BLE001 - the user's constructor
            raise ConfigError(f"environment_factory={self.spec!r}: building an instance raised "
                              f"{type(e).__name__}: {e}") from None

    def _fresh(self, example: Example) -> tuple[Any, Any]:
        """(what reset returned, a new instance reset with the example's row), within user_code_timeout."""
        return user_calls(self).call(f"environment_factory {self.spec}: building and resetting an instance",
                                     fresh_reset, self.factory, example.meta)

    def reset(self, example: Example) -> list[dict[str, str]]:
        """The example's messages, with what the instance's reset returns appended to the last one's text
        (the group's episodes share this prompt; each gets its own instance, reset with the same row)."""
        observation, instance = self._fresh(example)
        self.instances.keep(example, instance)
        messages = [dict(m) for m in example.messages]
        if observation is not None:
            messages[-1]["content"] = joined(messages[-1]["content"], str(observation))
        return messages

    def start(self, episode: Episode) -> None:
        episode.state = self.instances.take(episode.example, lambda: self._fresh(episode.example)[1])

    def step(self, episode: Episode, reply: str) -> Turn:
        tools = public_methods(episode.state)
        calls = parse_tool_calls(reply, tools)
        if not calls:
            return Turn(None)
        messages, errors = [], 0
        for call in calls:
            text, ok = run_tool(tools.get(call.name), call)
            errors += not ok
            messages.append({"role": "tool", "name": call.name, "content": text})
        return Turn(messages, tool_calls=len(calls), tool_errors=errors)

    def reward(self, episode: Episode) -> Reward:
        if self.scored_by == "reward_funcs":
            return self.data.function_rewards([episode.example], [episode.transcript], environments=[episode.state])[0]
        if self.scored_by == "get_reward":
            value = user_calls(self).call(f"environment_factory {self.spec}: get_reward", instance_reward,
                                          episode.state)
            return Reward(total=value, components={"reward": value})
        return self.data.reward(episode.example, episode.last_reply)

    def finish(self, episode: Episode) -> None:
        for fresh in self.instances.drop(episode.example):
            close = getattr(fresh, "close", None)
            if callable(close):
                close()
