"""Run health: one warning line when a run cannot learn, instead of silence.

Checked after every RL step on its logged metrics (thresholds are config fields):
- truncation: ≥ health_truncated_frac (0.9) of completions cut at max_new_tokens for health_steps (3)
  steps in a row: the reward sees cut answers (TRL users lost days to a 256-token default);
- no reward spread: ≥ health_zero_spread_frac (0.9) of groups with all-equal rewards for health_steps
  steps in a row: those groups give no gradient;
- constant reward: every completion of a step scored the same, health_steps steps in a row (said as "learned"
  when that score is above the first step's mean; it implies no spread, which is then not said again);
- reward errors: every completion's reward call of a step failed, health_steps steps in a row: the run stops
  (with a checkpoint), strict_health or not, as nothing it learns then comes from a reward;
- KL: train/kl above health_max_kl (1.0 per token), the policy far from the reference;
- clipping: train/clip_frac above health_max_clip_frac (0.3), updates much larger than the clip range.
A warning is given once when its condition starts and again only after it cleared. With
strict_health the first warning stops the run cleanly (with a checkpoint) instead.

Once per run: a grader that finds no answer in most completions of a step or an eval, shown on one of them
with the graders that do read it (tasks/dataset.py: unread_hint), so that zeros are explained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Health:
    """The state of the checks across steps (saved with checkpoints, so a resumed run continues it)."""

    streaks: dict[str, int] = field(default_factory=dict)  # condition → consecutive steps it held
    active: list[str] = field(default_factory=list)  # conditions warned about and not cleared since
    told: list[str] = field(default_factory=list)  # once-per-run warnings given
    totals: list[int] = field(default_factory=lambda: [0, 0])  # reward/errors, rollout/completions at the last check
    first_mean: float | None = None  # reward/mean of the run's first checked step

    def once(self, name: str, text: str | None) -> str | None:
        """`text` the first time the once-per-run warning `name` has one, else None."""
        if text is None or name in self.told:
            return None
        self.told.append(name)
        return text

    def check(self, cfg, metrics: dict[str, Any], unread: str | None = None) -> list[str]:
        """The warnings this step's metrics raise (each once per episode of its condition), and `unread` (the
        grader's unread_hint on the step's completions) the first time there is one."""
        rewards_flat = metrics.get("reward/min") == metrics.get("reward/max")
        now = [metrics.get("reward/errors", 0), metrics.get("rollout/completions", 0)]
        errors, completions = now[0] - self.totals[0], now[1] - self.totals[1]  # this step's
        self.totals = now
        conditions = {
            "reward_errors": completions > 0 and errors >= completions,
            "truncated": metrics.get("rollout/truncated_frac", 0.0) >= cfg.health_truncated_frac,
            "zero_spread": metrics.get("rollout/zero_spread_frac", 0.0) >= cfg.health_zero_spread_frac,
            "constant_reward": rewards_flat,
            "kl": (metrics.get("train/kl") or 0.0) > cfg.health_max_kl,
            "clip_frac": (metrics.get("train/clip_frac") or 0.0) > cfg.health_max_clip_frac,
        }
        if self.first_mean is None:
            self.first_mean = metrics.get("reward/mean")
        persistent = {"truncated", "zero_spread", "constant_reward", "reward_errors"}
        fired = []
        for name, holds in conditions.items():
            self.streaks[name] = self.streaks.get(name, 0) + 1 if holds else 0
            due = self.streaks[name] >= (cfg.health_steps if name in persistent else 1)
            if not holds and name in self.active:
                self.active.remove(name)
            elif due and name not in self.active:
                self.active.append(name)
                fired.append(name)
        # one line per cause: failing reward calls make the reward constant, a constant reward leaves no spread
        for cause, implied in (("reward_errors", ("constant_reward", "zero_spread")), ("constant_reward", ("zero_spread",))):
            if cause in fired:
                fired = [name for name in fired if name not in implied]
        out = [self.message(name, cfg, metrics) for name in fired]
        return out + ([hint] if (hint := self.once("unread", unread)) else [])

    def message(self, name: str, cfg, m: dict[str, Any]) -> str:
        steps = f"{cfg.health_steps} steps in a row"
        if name == "truncated":
            return (f"{m['rollout/truncated_frac']:.0%} of completions were cut at max_new_tokens={cfg.max_new_tokens} "
                    f"for {steps}: the reward sees unfinished answers; raise max_new_tokens")
        if name == "reward_errors":
            return (f"every reward call failed for {steps} (reward/errors {m.get('reward/errors')}): the run learns from "
                    "errors scored 0, not from rewards; --strict_rewards stops at the first error and shows it")
        if name == "zero_spread":
            return (f"{m['rollout/zero_spread_frac']:.0%} of groups have no reward spread for {steps}: they give no "
                    "gradient; try --dynamic_sampling true, a larger group_size, or an easier task")
        if name == "constant_reward" and self.first_mean is not None and m["reward/mean"] > self.first_mean + 1e-9:
            return (f"every completion scored {m['reward/mean']:.4g} for {steps}, up from a mean of {self.first_mean:.4g} "
                    "at the first step: the task looks learned, and groups without spread give no gradient; stop "
                    "here, or make the task harder")
        if name == "constant_reward":
            return (f"every completion scored {m['reward/mean']:.4g} for {steps}: no reward spread, nothing to learn "
                    "from; check the "
                    "reward function and the completions in samples.jsonl")
        if name == "kl":
            return (f"train/kl = {m['train/kl']:.3g} per token exceeds health_max_kl={cfg.health_max_kl}: the policy is "
                    "far from the reference; lower lr or raise kl_coef")
        return (f"train/clip_frac = {m['train/clip_frac']:.3g} exceeds health_max_clip_frac={cfg.health_max_clip_frac}: "
                "updates move the ratio far past the clip range; lower lr")
