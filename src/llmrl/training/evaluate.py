"""Greedy evaluation on a task's eval examples, through the run's rollout engine."""

from __future__ import annotations

import sys
from typing import Any

from llmrl.rollout.base import RolloutEngine
from llmrl.tasks import Example, Task
from llmrl.tasks.score import score
from llmrl.training.distributed import Dist


def evaluate(engine: RolloutEngine, task: Task, examples: list[Example], *, max_new_tokens: int,
             dist: Dist | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy-decode every example; return (metrics named eval/…, one sample row per example).
    With several ranks, each decodes a contiguous shard and the texts are gathered. Rewards go
    through the same scoring as training: one that raises scores 0 and is counted in eval/reward_errors."""
    dist = dist or Dist()
    per_rank = -(-len(examples) // dist.world)
    mine = examples[dist.rank * per_rank : (dist.rank + 1) * per_rank]
    texts, truncated = engine.greedy([ex.messages for ex in mine], max_new_tokens) if mine else ([], 0)
    gathered = dist.gather((texts, truncated))
    texts, truncated = [t for part, _ in gathered for t in part], sum(n for _, n in gathered)
    scores = score(task, examples, texts, strict=False, where="eval")
    try:
        metrics = {f"eval/{k}": v for k, v in task.evaluate(examples, texts).items()}
    except Exception as e:  # noqa: BLE001 - a user's evaluate may raise anything; the run goes on
        print(f"llmrl: eval: the task's evaluate raised {type(e).__name__}: {e}; only eval/reward is logged",
              file=sys.stderr)
        metrics = {}
    n = max(len(examples), 1)
    metrics["eval/reward"] = sum(r.total for r in scores.rewards) / n
    metrics["eval/reward_errors"] = scores.errors
    metrics["eval/truncated_frac"] = truncated / n
    rows = [
        {"prompt": ex.messages[-1]["content"], "answer": ex.answer, "completion": t, "reward": r.total}
        for ex, t, r in zip(examples, texts, scores.rewards)
    ]
    return metrics, rows
