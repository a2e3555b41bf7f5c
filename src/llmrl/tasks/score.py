"""Scoring completions with a task's reward: the one path used by training and by eval, so a reward
that raises or is not a finite number is handled the same way everywhere. A reward call into user code that
overran user_code_timeout (CallTimeout: tasks/workers.py, tasks/custom.py) is such an error too, and its zero
reward carries the count `timeouts` (logged as reward/timeouts); too many overrunning calls still running
(UserCodeStuck) or one that nothing can stand in for (UserCodeOverran) stop the run."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llmrl.errors import EngineDied, RunStopped
from llmrl.rng import kept_rng_state
from llmrl.tasks.base import Example, Reward, Task
from llmrl.tasks.env import finish_episodes
from llmrl.tasks.workers import CallTimeout


@dataclass
class Scores:
    rewards: list[Reward]  # one per completion, in order
    errors: int  # completions whose reward raised, overran or was not finite (they score 0)
    timeouts: int = 0  # of those, the ones whose reward call overran user_code_timeout


def _number(value: Any) -> float | int:
    """A NumPy or torch scalar (np.float32, np.int64, np.bool_, torch.tensor(0.5)) as the Python number it holds;
    other numbers (Fraction, Decimal) as floats."""
    value = value.item() if hasattr(value, "item") else value
    return value if isinstance(value, (float, int)) else float(value)


# reward/<name> keys llmrl logs itself, and the shaping terms it adds as components: a task's component or count
# under one of these names would overwrite them in metrics.jsonl
TIMEOUTS = "timeouts"  # the count a zero reward carries when its call overran (reward/timeouts)
RESERVED = ("mean", "std", "min", "max", "errors", TIMEOUTS, "overlong", "kl_penalty")


class ReservedName(RunStopped):
    """A reward component or count named like a metric llmrl logs itself (the loop checkpoints the last step and
    stops in one line)."""


def _checked(r: Reward) -> Reward:
    """`r` with plain Python numbers throughout (the logs are JSON), after checking its total is finite and
    that no component or count takes a name llmrl logs itself (ReservedName: one line, the run stops)."""
    names = [str(k) for k in (*r.components, *r.counts, *r.metrics)]
    clash = [k for k in names if k in RESERVED]
    if clash:
        raise ReservedName(f"the reward names a component or count {clash[0]!r}, which would overwrite llmrl's own "
                           f"reward/{clash[0]} in the logs; rename it (taken: {', '.join(RESERVED)})")
    if len(set(names)) != len(names):
        raise ValueError(f"the reward names one thing twice among its components, counts and metrics: {sorted(names)}")
    total = float(_number(r.total))
    if not math.isfinite(total):
        raise ValueError(f"reward is {r.total}")
    metrics = {str(k): float(_number(v)) for k, v in r.metrics.items()}
    if not all(math.isfinite(v) for v in metrics.values()):
        raise ValueError(f"a reward metric is not finite: {metrics}")
    return replace(r, total=total, components={str(k): float(_number(v)) for k, v in r.components.items()},
                   counts={str(k): _number(v) for k, v in r.counts.items()}, metrics=metrics)


def score(task: Task, examples: list[Example], texts: list[str], *, strict: bool, where: str) -> Scores:
    """Score every completion (all at once if the task has `reward_batch`). A reward that raises or is
    not a finite number scores 0 and is counted; with `strict`, it stops the run instead (`where`
    names the step or eval for that message). The global RNGs are kept (a task may reseed them)."""
    with kept_rng_state():
        return _score(task, examples, texts, strict=strict, where=where)


def _score(task: Task, examples: list[Example], texts: list[str], *, strict: bool, where: str) -> Scores:
    if hasattr(task, "reward_batch"):
        try:
            rewards = [_checked(r) for r in task.reward_batch(examples, texts)]
            if len(rewards) == len(texts):
                return Scores(rewards, 0)
        except EngineDied:  # user code that stops the run (too many overrunning calls still running)
            raise
        except Exception:  # noqa: BLE001 - find which completion fails, one by one
            pass
    tally = _Tally()
    for ex, text in zip(examples, texts, strict=True):
        tally.add(lambda: task.reward(ex, text), strict, f"{where}: the reward function")  # noqa: B023
    return tally.scores()


class _Tally:
    """Rewards scored one at a time, and how many failed (raised, overran, not finite) and overran."""

    def __init__(self) -> None:
        self.rewards: list[Reward] = []
        self.errors = self.timeouts = 0

    def add(self, compute, strict: bool, what: str) -> None:
        """compute() checked finite; when it raised, a zero reward, counted (with `strict`: RunStopped naming
        `what`); a CallTimeout's zero reward carries the count `timeouts`."""
        try:
            self.rewards.append(_checked(compute()))
            return
        except (ReservedName, EngineDied):
            raise
        except Exception as e:  # noqa: BLE001 - a user's reward function or environment may raise anything
            if strict:
                did = f"overran: {e}" if isinstance(e, CallTimeout) else f"raised {type(e).__name__}: {e}"
                raise RunStopped(f"{what} {did} (--strict_rewards); the last checkpoint is intact") from None
            timed_out = isinstance(e, CallTimeout)
        self.errors += 1
        self.timeouts += timed_out
        self.rewards.append(Reward(total=0.0, components={}, counts={TIMEOUTS: 1} if timed_out else {}))

    def scores(self) -> Scores:
        return Scores(self.rewards, self.errors, self.timeouts)


def score_episodes(env, episodes: list, *, strict: bool, where: str) -> Scores:
    """Score multi-turn episodes with env.reward, handled like `score`: an episode that the environment
    ended by raising or timing out scores 0 (counted in rollout/env_errors, not here); a reward that
    raises or is not finite scores 0 and is counted (with `strict`, either stops the run). Then
    env.finish for every episode, whatever happened. The global RNGs are kept (tasks/env.py)."""
    tally = _Tally()
    try:
        for ep in episodes:
            if ep.cut == "env_error":
                if strict:
                    raise RunStopped(f"{where}: the environment failed: {ep.error} (--strict_rewards); the last checkpoint is intact")
                tally.rewards.append(Reward(total=0.0, components={}))
                continue
            with kept_rng_state():
                tally.add(lambda: env.reward(ep), strict, f"{where}: the environment's reward")  # noqa: B023
    finally:
        finish_episodes(env, episodes, where)
    return tally.scores()
