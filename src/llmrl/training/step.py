"""One RL step, `train_step(run, step) -> StepResult`: `collect` (steps 1-4), then `learn` (step 5).

    1. examples = task.sample_train_batch(B)              (the task's own seeded RNG; run.rollouts.draw,
    2. rollout  = G episodes per prompt                     training/rollouts.py: run_episodes on the engine,
                  + old/ref log-probs (add_logprobs)          one turn for a single-turn task)
    3. rewards  = score(task, ...) [N] and their components (+ overlong / KL-in-reward terms;
                  dynamic_sampling refills groups with equal rewards)
    4. adv      = clamp(ADVANTAGE_ESTIMATORS[adv_estimator](rewards, G), ±adv_clip) [N]
    5. update   = policy_update: ppo_epochs × shuffled minibatches, LOSSES[algo], KL_ESTIMATORS[kl_estimator]

With several ranks, every rank draws the same B prompts and samples its contiguous share; rewards,
lengths and texts are gathered so advantages and logs cover the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmrl.algorithms.core import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    masked_mean,
    normalize_advantages,
    overlong_penalty,
    zero_spread_fraction,
)
from llmrl.batch import Counts, DynamicCounts, LagCounts, merge
from llmrl.config import TrainConfig
from llmrl.rollout import Rollout, add_logprobs
from llmrl.rollout.base import concat_rollouts, select_rows
from llmrl.rollout.episodes import episode_counts
from llmrl.tasks import Example, Reward
from llmrl.tasks.env import Episode, prompt_text
from llmrl.tasks.score import score, score_episodes
from llmrl.training.rollouts import Drawn, draw
from llmrl.training.fsdp import gathered
from llmrl.training.run import Run
from llmrl.training.update import UpdateBatch, UpdateStats, add_diff, policy_update, warmup_factor


@dataclass
class Sampled:
    """This rank's completions of one step (n = its share of N), prompt-major."""

    owners: list[Example]  # [n] the example each completion answers
    rollout: Rollout
    rewards: list[Reward]  # [n]
    counts: Counts = field(default_factory=Counts)  # reward_errors, prompts_skipped, episodes, sampling rounds...
    generate_s: float = 0.0  # where the rollout's time went: sampling (and loading the engine's policy) ...
    logprobs_s: float = 0.0  # ... and the trainer's old/ref forwards
    episodes: list[Episode] | None = None  # [n] environments: the episodes the rows hold


@dataclass
class StepResult:
    metrics: dict[str, Any]  # the step's metrics.jsonl record (without "step")
    samples: list[dict[str, Any]]  # its samples.jsonl rows (empty when not logged this step)
    unread: str | None = None  # the grader found no answer in most completions: one line saying so (health.py)


def score_drawn(run: Run, d: Drawn, step: int) -> Sampled:
    """Steps 2-3 on the trainer: old (unless the engine's) and reference log-probs of a draw, its rewards."""
    cfg, plan, g = run.cfg, run.plan, run.cfg.group_size
    t0 = time.perf_counter()
    out = d.rollout
    if plan.engine_old:  # the engine's own sampled-token log-probs are the behaviour policy
        out.logp_old = out.engine_logp
    out = add_logprobs(run.model, out, chunk=plan.score_chunk, token_budget=plan.token_budget, group_size=g,
                       shared_prefix=plan.shared_prefix_scoring, with_ref=plan.with_ref)
    logprobs_s = time.perf_counter() - t0
    owners = [ex for ex in d.examples for _ in range(g)]  # prompt-major, like the completions
    counts = Counts(prompts_skipped=d.skipped, prompts_truncated=out.prompts_truncated)
    if d.episodes is not None:
        scores = score_episodes(run.task, d.episodes, strict=cfg.strict_rewards, where=f"step {step}")
        counts.episodes = episode_counts(d.episodes, run.episodes.abandoned())
    else:
        scores = score(run.task, owners, out.texts, strict=cfg.strict_rewards, where=f"step {step}")
    counts.reward_errors = scores.errors
    return Sampled(owners, out, scores.rewards, counts, d.generate_s, logprobs_s, d.episodes)


def sample_and_score(run: Run, step: int, drawn: Drawn) -> Sampled:
    """Steps 1-3: B prompts, G completions each (the first round `drawn`), their rewards.

    With dynamic_sampling (DAPO), groups whose rewards are all equal are set aside and more prompts are
    sampled (up to dynamic_sampling_rounds rounds) until B groups have a spread; set-aside groups fill
    whatever is still missing (dynamic sampling is single-process).
    """
    cfg, g = run.cfg, run.cfg.group_size
    if not cfg.dynamic_sampling:
        return score_drawn(run, drawn, step)
    kept: list[Sampled] = []  # groups with a reward spread
    flat: list[Sampled] = []  # groups without
    counts = Counts()  # over every round's prompts
    generate_s = logprobs_s = 0.0
    rounds = 0
    while rounds < cfg.dynamic_sampling_rounds and len(kept) < cfg.batch_size:
        d = drawn if rounds == 0 else draw(run, step, step - 1, rounds, cfg.batch_size - len(kept))
        s = score_drawn(run, d, step)
        counts = merge(counts, s.counts)  # prompts_truncated counted here: the rows below are picked per group
        generate_s, logprobs_s = generate_s + s.generate_s, logprobs_s + s.logprobs_s
        rounds += 1
        for i in range(len(d.examples)):
            rows = list(range(i * g, (i + 1) * g))
            group = Sampled([s.owners[j] for j in rows], select_rows(s.rollout, rows), [s.rewards[j] for j in rows],
                            episodes=None if s.episodes is None else [s.episodes[j] for j in rows])
            (kept if len({r.total for r in group.rewards}) > 1 else flat).append(group)
    filled = max(0, cfg.batch_size - len(kept))
    groups = kept[: cfg.batch_size] + flat[:filled]
    counts.dynamic = DynamicCounts(sampling_rounds=rounds, groups_flat_dropped=len(flat) - filled, groups_flat_kept=filled)
    return Sampled([ex for grp in groups for ex in grp.owners],
                   concat_rollouts([grp.rollout for grp in groups], run.tokenizer.pad_token_id),
                   [r for grp in groups for r in grp.rewards], counts, generate_s, logprobs_s,
                   None if drawn.episodes is None else [ep for grp in groups for ep in grp.episodes])


def shaped_rewards(run: Run, s: Sampled) -> torch.Tensor:
    """The task rewards plus the shaping terms [n] (each also logged as a reward component, on the CPU like
    the rewards, whatever device the rollout is on): DAPO's soft overlong penalty on a row's sampled tokens
    against the episode's token budget (max_new_tokens for one reply, episode_tokens for an environment's
    replies together), and the KL penalty −kl_coef · Σ_t KL_t when kl_in_reward. With overlong_filter,
    truncated completions (an episode's last reply cut by a token cap) leave the completion mask (they teach
    nothing)."""
    cfg, out = run.cfg, s.rollout
    terms: dict[str, torch.Tensor] = {}
    if cfg.overlong_buffer > 0:
        terms["overlong"] = overlong_penalty(out.completion_lens.cpu(), run.episodes.limits.episode_tokens,
                                             cfg.overlong_buffer, cfg.overlong_penalty)
    if cfg.kl_in_reward:
        per_token = KL_ESTIMATORS[cfg.kl_estimator](out.logp_old, out.logp_ref) * out.completion_mask  # [n, L-1]
        terms["kl_penalty"] = -cfg.kl_coef * per_token.sum(1).float().cpu()
    rewards_t = torch.tensor([r.total for r in s.rewards], dtype=torch.float32)
    for name, values in terms.items():
        rewards_t += values
        for r, v in zip(s.rewards, values.tolist()):
            r.components[name] = v
    if cfg.overlong_filter:
        out.completion_mask[~out.ended] = 0.0
    return rewards_t


def advantages(cfg: TrainConfig, rewards: torch.Tensor) -> torch.Tensor:
    """Step 4 over the global batch (every estimator is exact with any number of ranks): [N] → [N]."""
    adv = ADVANTAGE_ESTIMATORS[cfg.adv_estimator](rewards, cfg.group_size)
    if cfg.normalize_advantages:
        adv = normalize_advantages(adv, cfg.group_size)
    return adv.clamp(-cfg.adv_clip, cfg.adv_clip)


@dataclass
class Gathered:
    """A step's rows as every rank sees them: one rank's share (`gather` builds it), or all of them, in
    rank (= global row) order."""

    owners: list[Example]  # [N]
    texts: list[str]
    rewards: list[Reward]
    rewards_t: torch.Tensor  # [N] task rewards plus shaping terms
    lengths: torch.Tensor  # [N] sampled tokens (EOS included), before overlong_filter
    scored: torch.Tensor  # [N] tokens the loss sees (after overlong_filter)
    ended: torch.Tensor  # [N] bool
    counts: Counts  # merged over ranks
    transcripts: list[list[dict[str, str]] | None]  # [N] environments: each episode's messages after the prompt
    prompts: list[str]  # [N] the prompt's text (an environment's: the last message its reset built)
    first_row: int = 0  # this rank's first global row


def gather(run: Run, s: Sampled, rewards_t: torch.Tensor, lengths: torch.Tensor) -> Gathered:
    """Every rank's rows, rewards and counts, for advantages and logs over the global batch. `lengths` [n]:
    this rank's rows' sampled tokens (before overlong_filter took truncated rows out of the mask)."""
    out = s.rollout
    mine = Gathered(s.owners, out.texts, s.rewards, rewards_t, lengths, out.completion_mask.sum(1).cpu(), out.ended.cpu(),
                    s.counts, [ep.transcript for ep in s.episodes] if s.episodes else [None] * len(s.owners),
                    [prompt_text(ex, ep) for ex, ep in zip(s.owners, s.episodes or [None] * len(s.owners))])
    parts = run.dist.gather(mine)  # one collective
    return Gathered(
        owners=[o for p in parts for o in p.owners], texts=[t for p in parts for t in p.texts],
        rewards=[r for p in parts for r in p.rewards], rewards_t=torch.cat([p.rewards_t for p in parts]),
        lengths=torch.cat([p.lengths for p in parts]), scored=torch.cat([p.scored for p in parts]),
        ended=torch.cat([p.ended for p in parts]), counts=functools.reduce(merge, [p.counts for p in parts]),
        transcripts=[t for p in parts for t in p.transcripts], prompts=[t for p in parts for t in p.prompts],
        first_row=sum(len(p.rewards) for p in parts[: run.dist.rank]),
    )


@dataclass
class Collected:
    """What `collect` hands to `learn`: this rank's rows and rewards, the global batch, its advantages."""

    sampled: Sampled  # this rank's rows (Rollout), rewards, episodes
    batch: Gathered  # every rank's rewards, lengths, texts
    adv: torch.Tensor  # [N] global advantages
    rollout_s: float  # the rollout's wall time on this rank (sampling, old/ref log-probs, rewards)


def collect(run: Run, step: int) -> Collected:
    """Steps 1-4: prompts, G rollouts each, rewards, advantages. The rollouts come from run.rollouts: drawn
    now from the policy before this step (version step-1), or, one step ahead (max_staleness), during the
    step before (version step-2)."""
    t0 = time.perf_counter()
    with gathered(run.model):  # FSDP2: rollouts and their log-probs on the whole model (a no-op unsharded)
        s = sample_and_score(run, step, run.rollouts.draw(step))
    if run.plan.one_ahead:
        lag = (step - 1) - s.rollout.version
        s.counts.lag = LagCounts(lag_sum=int(lag.sum()), rows=len(lag), lag_max=int(lag.max()))
    lengths = s.rollout.completion_lens.cpu()  # sampled tokens, before overlong_filter masks truncated rows
    rewards_t = shaped_rewards(run, s)
    rollout_s = time.perf_counter() - t0
    g = gather(run, s, rewards_t, lengths)
    return Collected(s, g, advantages(run.cfg, g.rewards_t), rollout_s)


def learn(run: Run, c: Collected, step: int) -> tuple[UpdateStats, float]:
    """Step 5 on this rank's rows, with step's learning rate: the update's stats (means over ranks, and the
    engine's log-prob difference summed over them) and its seconds."""
    cfg, out, g = run.cfg, c.sampled.rollout, c.batch
    for group in run.optimizer.param_groups:  # warmup counted in RL steps, as the starter does
        group["lr"] = cfg.lr * warmup_factor(step - 1, cfg.warmup_steps)
    t0 = time.perf_counter()
    n, device, mask = out.input_ids.shape[0], out.input_ids.device, out.completion_mask  # mask [n, L-1]
    batch = UpdateBatch(
        input_ids=out.input_ids, attention_mask=out.attention_mask, completion_mask=mask,
        logp_old=out.logp_old, logp_ref=out.logp_ref, adv=c.adv[g.first_row : g.first_row + n].to(device),
        group=torch.arange(n, device=device) // cfg.group_size, prompt_len=out.prompt_len,
        lengths=g.scored.to(device), offset=g.first_row, logp_engine=out.engine_logp, spans=out.spans,
    )
    stats = policy_update(run.model, run.optimizer, batch, run.update, run.shuffle, run.dist)
    if out.entropy is not None:  # the sampling policy's, T = 1 (not with old_logprobs=engine: vLLM returns no entropies)
        stats.entropy = masked_mean(out.entropy, mask).item()
    if out.engine_logp is not None:  # (Σ|engine − trainer|, tokens, max) of the sampled tokens' log-probs at θ_old
        stats.engine_diff = (stats.engine_diff if run.plan.engine_old
                             else add_diff(None, out.logp_old, out.engine_logp, mask)) or (0.0, 0.0, 0.0)
        # rows a version behind (async): the policy's change since, plus the engine's mismatch
        stats.lagged = out.version is not None and bool((out.version < run.learned).any())
    ranks = run.dist.gather(stats)  # one collective for all the statistics
    stats = dataclasses.replace(stats, **{k: sum(getattr(r, k) for r in ranks) / run.dist.world
                                          for k in stats.MEAN_FIELDS + (("entropy",) if out.entropy is not None else ())})
    if stats.engine_diff is not None:
        diffs = [r.engine_diff for r in ranks]
        stats.engine_diff = (sum(d[0] for d in diffs), sum(d[1] for d in diffs), max(d[2] for d in diffs))
    return stats, time.perf_counter() - t0


def step_record(run: Run, c: Collected, stats: UpdateStats, update_s: float) -> dict[str, Any]:
    """Add the step to run.totals and return its metrics.jsonl record (without "step"; docs/metrics.md)."""
    cfg, totals, g, adv = run.cfg, run.totals, c.batch, c.adv
    totals.bad_in_a_row = stats.trailing_skips if stats.optimizer_steps else totals.bad_in_a_row + stats.skipped_updates
    totals.optimizer_steps += stats.optimizer_steps
    totals.skipped_updates += stats.skipped_updates + stats.empty_minibatches
    totals.empty_minibatches += stats.empty_minibatches
    totals.reward_errors += g.counts.reward_errors
    totals.prompts_skipped += g.counts.prompts_skipped
    totals.completions += len(g.rewards)
    totals.train_seconds += c.rollout_s + update_s
    rewards, rewards_t, n, lengths = g.rewards, g.rewards_t, len(g.rewards), g.lengths.float()
    record = {"reward/mean": rewards_t.mean().item(), "reward/std": rewards_t.std(unbiased=False).item(),
              "reward/min": rewards_t.min().item(), "reward/max": rewards_t.max().item()}
    for name in dict.fromkeys(k for r in rewards for k in r.components):
        record[f"reward/{name}"] = sum(r.components.get(name, 0.0) for r in rewards) / n
    for name in dict.fromkeys(k for r in rewards for k in r.counts):
        record[f"reward/{name}"] = sum(r.counts.get(name, 0) for r in rewards)
    for name in dict.fromkeys(k for r in rewards for k in r.metrics):  # the mean over the rows that report it
        values = [r.metrics[name] for r in rewards if name in r.metrics]
        record[f"reward/{name}"] = sum(values) / len(values)
    record |= {"adv/mean": adv.mean().item(), "adv/std": adv.std(unbiased=False).item(),
               "adv/min": adv.min().item(), "adv/max": adv.max().item(),
               "rollout/zero_spread_frac": zero_spread_fraction(rewards_t, cfg.group_size)}
    record |= {f"train/{k}": getattr(stats, k) for k in (*stats.MEAN_FIELDS, "grad_norm", "lr")}
    if stats.state_mb is not None:
        record["train/state_mb"] = stats.state_mb  # rank 0's
    if stats.entropy is not None:
        record["train/entropy"] = stats.entropy
    if stats.engine_diff is not None:  # with the policy's lag (async) under another name
        name = "rollout/lagged_logprob_diff" if stats.lagged else "rollout/engine_logprob_diff"
        record[name] = stats.engine_diff[0] / max(stats.engine_diff[1], 1.0)
        record[f"{name}_max"] = stats.engine_diff[2]
    return record | {
        "train/optimizer_steps": totals.optimizer_steps,
        "train/skipped_updates": totals.skipped_updates,
        "train/empty_minibatches": totals.empty_minibatches,
        "reward/errors": totals.reward_errors,
        "rollout/completion_len": lengths.mean().item(),
        "rollout/completion_len_max": lengths.max().item(),
        "rollout/truncated_frac": (~g.ended).float().mean().item(),
        "rollout/prompts_skipped": totals.prompts_skipped,
        **{f"rollout/{k}": v for k, v in g.counts.logged().items()},
        "rollout/completions": totals.completions,
        "time/rollout_s": c.rollout_s,
        "time/generate_s": c.sampled.generate_s,
        "time/logprobs_s": c.sampled.logprobs_s,
        "time/update_s": update_s,
        "time/train_s": totals.train_seconds,
    }


def train_step(run: Run, step: int) -> StepResult:
    """RL step `step` (1-based): collect, then learn; returns what to log. Updates run.totals."""
    c = collect(run, step)  # 1-4. prompts, rollouts, rewards, advantages
    stats, update_s = learn(run, c, step)  # 5. the update
    run.learned = step
    run.rollouts.drawn_from.pop(step, None)  # learned: a checkpoint no longer needs the task's state from before its prompts
    g = c.batch
    samples = []
    if run.cfg.sample_log_interval and step % run.cfg.sample_log_interval == 0:
        samples = [{"prompt": p, "answer": ex.answer, "completion": text, "reward": r.total,
                    "components": r.components, "advantage": a, "ended": bool(e),
                    **({"transcript": t} if t is not None else {})}
                   for ex, p, text, r, a, e, t in zip(g.owners, g.prompts, g.texts, g.rewards, c.adv.tolist(),
                                                      g.ended.tolist(), g.transcripts)]
    hint = getattr(run.task, "unread_hint", None)  # a dataset's grader (tasks/dataset.py)
    unread = hint([ex.answer for ex in g.owners], g.texts) if hint and c.sampled.episodes is None else None
    return StepResult(step_record(run, c, stats, update_s), samples, unread)
