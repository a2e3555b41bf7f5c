"""The step's counts, typed: what rollouts, rewards and rounds count, passed between the step's stages and merged
over rounds (dynamic sampling) and ranks without string keys.

Each field says how two parts combine: a sum (the default) or a maximum (`MAX`). A part that is absent (None:
no environment, no dynamic sampling, no async) stays absent. `logged()` turns the merged counts of a step into
its rollout/ metrics (docs/metrics.md): means per episode or per row are taken there, after merging, so they
weigh every rank and round by its episodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX = {"merge": max}  # field metadata: two parts combine by their maximum, not their sum


def merge(a, b):
    """Two parts of the same counts (rounds, ranks) together, field by field: sums, maxima for MAX fields,
    nested counts merged, None where both are absent."""
    if a is None or b is None:
        return b if a is None else a
    if not dataclasses.is_dataclass(a):
        return a + b
    values = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        values[f.name] = f.metadata["merge"](x, y) if "merge" in f.metadata else merge(x, y)
    return type(a)(**values)


@dataclass
class EpisodeCounts:
    """Environments: sums over episodes (turns_max, env_abandoned: maxima)."""

    episodes: int = 0
    turns: int = 0  # policy replies
    turns_max: int = field(default=0, metadata=MAX)
    tool_calls: int = 0
    tool_errors: int = 0
    env_tokens: int = 0
    env_truncated: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    cut_max_turns: int = 0
    cut_episode_tokens: int = 0
    cut_reply_tokens: int = 0
    env_abandoned: int = field(default=0, metadata=MAX)  # overrunning steps still running on a rank's threads

    def logged(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        out: dict[str, float] = {k: getattr(self, k) / n for k in ("turns", "tool_calls", "tool_errors", "env_tokens")}
        for k in ("env_truncated", "env_errors", "env_timeouts", "cut_max_turns", "cut_episode_tokens",
                  "cut_reply_tokens", "turns_max", "env_abandoned"):
            out[k] = getattr(self, k)
        return out


@dataclass
class DynamicCounts:
    """dynamic_sampling: the rounds a step took and what became of the groups without a reward spread."""

    sampling_rounds: int = 0
    groups_flat_dropped: int = 0
    groups_flat_kept: int = 0


@dataclass
class LagCounts:
    """max_staleness: policy versions between the rows' sampling policy and the one that learns from them."""

    lag_sum: int = 0
    rows: int = 0
    lag_max: int = field(default=0, metadata=MAX)


@dataclass
class Counts:
    """A step's counts (one round, one rank, or merged)."""

    prompts_skipped: int = 0  # redrawn for being too long (long_prompts=skip)
    prompts_truncated: int = 0  # cut to max_prompt_tokens (long_prompts=truncate)
    reward_errors: int = 0  # reward calls that raised (scored 0)
    episodes: EpisodeCounts | None = None
    dynamic: DynamicCounts | None = None
    lag: LagCounts | None = None

    def logged(self) -> dict[str, float]:
        """The step's rollout/ metrics from these counts, without the prefix (prompts_skipped and reward_errors
        are logged as run totals by the step record)."""
        out: dict[str, float] = {"prompts_truncated": self.prompts_truncated}
        if self.episodes is not None:
            out |= self.episodes.logged()
        if self.dynamic is not None:
            out |= dataclasses.asdict(self.dynamic)
        if self.lag is not None:
            out |= {"policy_lag": self.lag.lag_sum / max(self.lag.rows, 1), "policy_lag_max": self.lag.lag_max}
        return out
