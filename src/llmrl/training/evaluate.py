"""Evaluation on a task's eval examples, played as episodes by the run's rollout engine (the rows a
training step would make): greedy (one completion per prompt), or sampled (eval_samples_per_prompt = k > 1)
with pass@k and maj@k."""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any

from llmrl.rollout.base import RolloutEngine, Sampling
from llmrl.rollout.episodes import EpisodeRunner
from llmrl.rollout.keyed import mix
from llmrl.tasks import Example, Task
from llmrl.tasks.base import Judgement, Reward
from llmrl.rng import kept_rng_state
from llmrl.tasks.env import prompt_text
from llmrl.tasks.score import score, score_episodes
from llmrl.training.distributed import Dist

EVAL_NOISE = 0xE7A1  # sampled eval's noise: keyed by (run seed, this, prompt index, sample index), the same every eval


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n samples of which c are correct: 1 − C(n−c, k)/C(n, k),
    the chance that k samples drawn without replacement from the n hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 ≤ c ≤ n and 1 ≤ k ≤ n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(judged: list[Judgement]) -> bool:
    """maj@k of one prompt's k samples: the most common answer (ties: the one seen first) is correct.
    Samples without an answer do not vote; with no answer at all it is not correct."""
    votes = Counter(j.answer for j in judged if j.answer is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(j.answer for j in judged if j.answer is not None and votes[j.answer] == top)
    return any(j.correct for j in judged if j.answer == winner)


def pass_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples per prompt: 1, 2, 4, … below n, and n."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) < n]
    return ks + [n]


def judge(task: Task, examples: list[Example], texts: list[str], rewards: list[Reward]) -> list[Judgement] | None:
    """The task's own correctness per completion: task.judge, else a reward component named "correct"
    (a custom task's), else None (no pass@k for this task)."""
    if hasattr(task, "judge"):
        return task.judge(examples, texts)
    if rewards and all("correct" in r.components for r in rewards):
        return [Judgement(r.components["correct"] > 0) for r in rewards]
    return None


def sampled_metrics(judged: list[Judgement], k: int, majority: bool = True) -> dict[str, float]:
    """eval/pass@j for j in pass_ks(k), and eval/maj@k when the task compares answers (`majority`), from
    k judged samples per prompt (prompt-major)."""
    groups = [judged[i : i + k] for i in range(0, len(judged), k)]
    out = {}
    for j in pass_ks(k):
        out[f"eval/pass@{j}"] = sum(pass_at_k(k, sum(x.correct for x in g), j) for g in groups) / max(len(groups), 1)
    if majority:
        out[f"eval/maj@{k}"] = sum(majority_correct(g) for g in groups) / max(len(groups), 1)
    return out


def evaluate(engine: RolloutEngine, task: Task, examples: list[Example], *, episodes: EpisodeRunner, batch: int,
             dist: Dist | None = None, samples_per_prompt: int = 1, sampling: Sampling, seed: int = 0
             ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Play every example through `episodes` (rollout/episodes.py, the row builder a training step uses;
    a single-turn task's episodes have one turn), `batch` examples per engine call: greedy, or
    samples_per_prompt = k sampled episodes each with `sampling` (noise keyed by the run seed, EVAL_NOISE,
    prompt index and sample index: the same every eval). Returns (metrics named eval/…, one sample row
    per completion). With several ranks, each plays a contiguous shard and the results are gathered.
    Rewards go through the same scoring as training: one that raises scores 0 and is counted in
    eval/reward_errors. With k > 1 the task's metrics are means over all k·n completions, plus pass@j
    and maj@k."""
    dist = dist or Dist()
    k = samples_per_prompt
    per_rank = -(-len(examples) // dist.world)
    first = dist.rank * per_rank
    mine = examples[first : first + per_rank]
    played = []
    for i in range(0, len(mine), batch):
        played += episodes(engine, mine[i : i + batch], group_size=k, seed=mix(seed, EVAL_NOISE), first_prompt=first + i,
                           sampling=sampling, greedy=k == 1, logprobs=False)[1]
    if not episodes.single_turn:
        return environment_metrics(task, [ep for part in dist.gather(played) for ep in part], k)
    gathered = dist.gather([(ep.last_reply, ep.truncated) for ep in played])
    texts, truncated = [t for part in gathered for t, _ in part], sum(cut for part in gathered for _, cut in part)
    owners = [ex for ex in examples for _ in range(k)]  # prompt-major, like the completions
    scores = score(task, owners, texts, strict=False, where="eval")
    metrics = common_metrics(lambda: task.evaluate(owners, texts), "task", scores, truncated)
    if k > 1 and (judged := judge(task, owners, texts, scores.rewards)) is not None:
        metrics |= sampled_metrics(judged, k, majority=hasattr(task, "judge"))  # a "correct" component has no answers
    rows = [
        {"prompt": prompt_text(ex), "answer": ex.answer, "completion": t,
         "reward": r.total}
        for ex, t, r in zip(owners, texts, scores.rewards)
    ]
    return metrics, rows


def common_metrics(task_metrics, what: str, scores, truncated: int) -> dict[str, float]:
    """The task's own metrics (eval/ added; none when its evaluate raises: the run goes on), eval/reward,
    eval/reward_errors and eval/truncated_frac (`truncated` of the scored completions or episodes)."""
    try:
        with kept_rng_state():
            metrics = {f"eval/{name}": v for name, v in task_metrics().items()}
    except Exception as e:  # noqa: BLE001 - a user's evaluate may raise anything; the run goes on
        print(f"llmrl: eval: the {what}'s evaluate raised {type(e).__name__}: {e}; only eval/reward is logged",
              file=sys.stderr)
        metrics = {}
    n = max(len(scores.rewards), 1)
    return metrics | {"eval/reward": sum(r.total for r in scores.rewards) / n, "eval/reward_errors": scores.errors,
                      "eval/truncated_frac": truncated / n}


def environment_metrics(env, played: list, k: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """`evaluate`'s metrics and rows for an environment's episodes (k per example): scored by env.reward;
    pass@j from env.correct when it says."""
    scores = score_episodes(env, played, strict=False, where="eval")
    metrics = common_metrics(lambda: env.evaluate(played), "environment", scores, sum(ep.truncated for ep in played))
    n = max(len(played), 1)
    metrics["eval/turns"] = sum(ep.replies for ep in played) / n
    metrics["eval/tool_calls"] = sum(ep.tool_calls for ep in played) / n
    with kept_rng_state():
        correct = [env.correct(ep) for ep in played] if k > 1 else []
    if played and correct and all(c is not None for c in correct):
        metrics |= sampled_metrics([Judgement(bool(c)) for c in correct], k, majority=False)
    rows = [{"prompt": prompt_text(ep.example, ep), "answer": ep.example.answer, "completion": ep.last_reply,
             "transcript": ep.transcript, "turns": ep.replies, "reward": r.total}
            for ep, r in zip(played, scores.rewards)]
    return metrics, rows
