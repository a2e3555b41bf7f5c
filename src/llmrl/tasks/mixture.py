"""A weighted mixture of tasks: `--task format_copy,math_hard` (or library tasks: `--task
reasoning_gym:chain_sum,format_copy`), each prompt drawn from one task, scored by that task, evaluated per task.

    task_args:                       # for a mixture: one mapping per task, and the weights
      weights: {format_copy: 3}      # default 1 each; a prompt comes from task t with probability w_t / Σw
      math_hard: {…}                 # that task's own task_args

Names are split at commas; a piece that is not a task name continues the one before it, so a library's own
list stays whole (`reasoning_gym:a,b,format_copy` is reasoning-gym's a and b, then format_copy; a library
dataset named like a registered task would start a new task). Each example
carries its task's name (`Example.source`). Logged: every task's reward components (means over all of the
step's completions, 0 where a task does not give that component), and `reward/<task>`: the mean reward of that
task's own completions (a metric, never summed). Eval: eval_n examples interleaved across the tasks, each
task's metrics as `eval/<task>/<metric>`, pass@k where every task judges its completions. Every task is
single-turn, or every task is an environment of one class per row is not supported yet: a mixture that holds
an environment is refused with one line.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from llmrl.errors import ConfigError
from llmrl.tasks.base import Example, Judgement, Reward, SeededSampling


def mixture_parts(task: str, is_name: Callable[[str], bool]) -> list[str] | None:
    """The task names of a comma-separated mixture (None: `task` is one task, or no mixture of names): a piece
    that is a task name starts a task, one that is not continues the one before it (a library's own list)."""
    if "," not in task:
        return None
    parts: list[str] = []
    for piece in task.split(","):
        if parts and not is_name(piece.strip()):
            parts[-1] += "," + piece.strip()
        else:
            parts.append(piece.strip())
    return parts if len(parts) > 1 and all(is_name(p) for p in parts) else None


class MixtureTask(SeededSampling):
    """Single-turn tasks mixed by weight; each example scored and evaluated by the task it came from."""

    name = "mixture"

    def __init__(self, seed: int, tasks: dict[str, Any], weights: dict[str, float] | None = None) -> None:
        from llmrl.tasks.env import is_environment

        envs = [n for n, t in tasks.items() if is_environment(t)]
        if envs:
            raise ConfigError(f"task mixture {','.join(tasks)}: {envs[0]} is an environment; a mixture holds "
                              "single-turn tasks only (for now)")
        weights = dict(weights or {})
        if set(weights) - set(tasks):
            raise ConfigError(f"task_args weights name tasks outside the mixture {list(tasks)}: {sorted(set(weights) - set(tasks))}")
        self.tasks, self.names = tasks, list(tasks)
        self.weights = [float(weights.get(n, 1.0)) for n in self.names]
        if not all(w >= 0 for w in self.weights) or not any(self.weights):
            raise ConfigError(f"task_args weights {weights}: must be non-negative, not all 0")
        self.rng = random.Random(seed)
        self.eval_n_default = max(getattr(t, "eval_n_default", 32) for t in tasks.values())
        reports = {n: getattr(t, "data_report", None) for n, t in tasks.items()}
        if any(reports.values()):
            self.data_report = {n: r for n, r in reports.items() if r}
        if all(hasattr(t, "judge") for t in tasks.values()):
            self.judge = self._judge  # pass@k / maj@k only where every task judges its completions

    @staticmethod
    def tagged(examples: list[Example], name: str) -> list[Example]:
        for ex in examples:
            ex.source = name
        return examples

    def sample_train_batch(self, n: int) -> list[Example]:
        """n examples, each from a task drawn by weight (the mixture's own RNG); each task draws its own."""
        picks = self.rng.choices(self.names, weights=self.weights, k=n)
        drawn = {name: iter(self.tagged(self.tasks[name].sample_train_batch(picks.count(name)), name))
                 for name in self.names if name in picks}
        return [next(drawn[name]) for name in picks]

    def eval_examples(self, n: int) -> list[Example]:
        """n examples, the tasks interleaved (the first eval_n hold each task)."""
        lists = {name: self.tagged(t.eval_examples(n), name) for name, t in self.tasks.items()}
        out: list[Example] = []
        for k in range(n):
            for name in self.names:
                if k < len(lists[name]) and len(out) < n:
                    out.append(lists[name][k])
        return out

    def by_task(self, examples: list[Example]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, ex in enumerate(examples):
            groups.setdefault(ex.source, []).append(i)
        return groups

    def reward(self, example: Example, completion: str) -> Reward:
        return self.tagged_reward(example.source, self.tasks[example.source].reward(example, completion))

    def tagged_reward(self, name: str, r: Reward) -> Reward:
        """The task's reward with its total as the metric `name` (reward/<task>: that task's mean)."""
        return Reward(total=r.total, components=r.components, counts=r.counts, metrics={**r.metrics, name: r.total})

    def reward_batch(self, examples: list[Example], completions: list[str]) -> list[Reward]:
        """Each task scores its own completions (all at once where it has reward_batch)."""
        out: list[Reward | None] = [None] * len(examples)
        for name, rows in self.by_task(examples).items():
            task = self.tasks[name]
            mine, texts = [examples[i] for i in rows], [completions[i] for i in rows]
            rewards = (task.reward_batch(mine, texts) if hasattr(task, "reward_batch")
                       else [task.reward(ex, c) for ex, c in zip(mine, texts)])
            for i, r in zip(rows, rewards):
                out[i] = self.tagged_reward(name, r)
        return out  # type: ignore[return-value]

    def _judge(self, examples: list[Example], completions: list[str]) -> list[Judgement]:
        out: list[Judgement | None] = [None] * len(examples)
        for name, rows in self.by_task(examples).items():
            for i, j in zip(rows, self.tasks[name].judge([examples[i] for i in rows], [completions[i] for i in rows])):
                out[i] = j
        return out  # type: ignore[return-value]

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, rows in self.by_task(examples).items():
            own = self.tasks[name].evaluate([examples[i] for i in rows], [completions[i] for i in rows])
            metrics |= {f"{name}/{k}": v for k, v in own.items()}
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"tasks": {n: t.state_dict() for n, t in self.tasks.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for n, t in self.tasks.items():
            t.load_state_dict(state["tasks"][n])
