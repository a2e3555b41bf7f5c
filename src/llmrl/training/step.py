"""One RL step, `train_step(run, step) -> StepResult`: `collect` (steps 1-4), then `learn` (step 5).

    1. examples = task.sample_train_batch(B)              (the task's own seeded RNG)
    2. rollout  = G episodes per prompt (run_episodes on the engine; one turn for a single-turn task)
                  + old/ref log-probs (add_logprobs)
    3. rewards  = score(task, ...) [N] and their components (+ overlong / KL-in-reward terms;
                  dynamic_sampling refills groups with equal rewards)
    4. adv      = clamp(ADVANTAGE_ESTIMATORS[adv_estimator](rewards, G), ±adv_clip) [N]
    5. update   = policy_update: ppo_epochs × shuffled minibatches, LOSSES[algo], KL_ESTIMATORS[kl_estimator]

With several ranks, every rank draws the same B prompts and samples its contiguous share; rewards,
lengths and texts are gathered so advantages and logs cover the global batch.
"""

from __future__ import annotations

import concurrent.futures
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
from llmrl.errors import RunStopped
from llmrl.rollout import Rollout, add_logprobs
from llmrl.rollout.base import concat_rollouts, select_rows
from llmrl.rollout.episodes import episode_counts
from llmrl.rollout.prompts import prompt_length
from llmrl.tasks import Example, Reward, Task
from llmrl.tasks.env import Episode, is_environment
from llmrl.tasks.score import score, score_episodes
from llmrl.training import hooks
from llmrl.training.run import Run
from llmrl.training.update import UpdateBatch, UpdateSettings, UpdateStats, add_diff, policy_update, warmup_factor


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step (the same on every rank: each completion's noise is keyed by it,
    its global prompt index and its place in the group), so resume and reruns draw the same completions."""
    return (seed * 1_000_003 + step * 7_919) % (2**63)


@dataclass
class Sampled:
    """This rank's completions of one step (n = its share of N), prompt-major."""

    owners: list[Example]  # [n] the example each completion answers
    rollout: Rollout
    rewards: list[Reward]  # [n]
    counts: Counts = field(default_factory=Counts)  # reward_errors, prompts_skipped, episodes, sampling rounds...
    seconds: dict[str, float] = field(default_factory=dict)  # generate_s, logprobs_s: where the rollout's time went
    episodes: list[Episode] | None = None  # [n] environments: the episodes the rows hold


@dataclass
class StepResult:
    metrics: dict[str, Any]  # the step's metrics.jsonl record (without "step")
    samples: list[dict[str, Any]]  # its samples.jsonl rows (empty when not logged this step)


def draw_prompts(task: Task, tokenizer, cfg: TrainConfig, n: int) -> tuple[list[Example], int]:
    """n prompts; with long_prompts=skip, prompts over max_prompt_tokens are redrawn (counted)."""
    if cfg.long_prompts == "truncate":
        return task.sample_train_batch(n), 0
    kept: list[Example] = []
    skipped = 0
    while len(kept) < n:
        for ex in task.sample_train_batch(n - len(kept)):
            if prompt_length(tokenizer, ex.messages) <= cfg.max_prompt_tokens:
                kept.append(ex)
            else:
                skipped += 1
        if skipped > 100 * cfg.batch_size:
            raise RunStopped(f"long_prompts=skip: {skipped} prompts in a row exceed max_prompt_tokens={cfg.max_prompt_tokens}")
    return kept, skipped


@dataclass
class Drawn:
    """One round of a step's rollouts as the engine returned them, before any trainer forward."""

    examples: list[Example]  # this rank's prompts
    skipped: int  # prompts redrawn for being too long (long_prompts=skip)
    rollout: Rollout  # G rows per prompt, rollout.version = `version`
    episodes: list[Episode] | None  # environments: the episodes the rows hold
    generate_s: float


def draw(run: Run, step: int, version: int, rounds: int = 0, need: int | None = None) -> Drawn:
    """Steps 1-2 without the trainer: `need` prompts (batch_size) and G rollouts each from the policy the
    engine holds, which is version `version` (loaded by the caller). It neither reads nor changes the
    trainer's weights, so a thread may run it while the trainer learns (max_staleness)."""
    cfg = run.cfg
    examples, skipped = draw_prompts(run.task, run.tokenizer, cfg, need or cfg.batch_size)
    first, stop = run.dist.shard(len(examples))
    examples = examples[first:stop]
    hooks.fire("before_rollout", step=step)
    t0 = time.perf_counter()
    seed = step_seed(cfg.seed, step) + 7_777 * rounds
    # token-in/token-out episodes (a single-turn task's have one turn), noise keyed (seed, prompt, g, turn)
    out, episodes = run.episodes(run.engine, examples, group_size=cfg.group_size, seed=seed, first_prompt=first,
                                 sampling=run.engine.sampling)
    run.engine.release()  # vLLM on CUDA sleeps now: the old/ref forwards get its memory (load wakes it)
    out.version = torch.full((out.input_ids.shape[0],), version, dtype=torch.long, device=out.input_ids.device)
    return Drawn(examples, skipped, out, episodes if is_environment(run.task) else None, time.perf_counter() - t0)


def score_drawn(run: Run, d: Drawn, step: int) -> Sampled:
    """Steps 2-3 on the trainer: old (unless the engine's) and reference log-probs of a draw, its rewards."""
    cfg, plan, g = run.cfg, run.plan, run.cfg.group_size
    t0 = time.perf_counter()
    out = d.rollout
    if plan.engine_old:  # the engine's own sampled-token log-probs are the behaviour policy
        out.logp_old = out.engine_logp
    out = add_logprobs(run.model, out, chunk=plan.score_chunk, token_budget=plan.token_budget, group_size=g,
                       shared_prefix=plan.shared_prefix_scoring, with_ref=plan.with_ref)
    seconds = {"generate_s": d.generate_s, "logprobs_s": time.perf_counter() - t0}
    owners = [ex for ex in d.examples for _ in range(g)]  # prompt-major, like the completions
    counts = Counts(prompts_skipped=d.skipped, prompts_truncated=out.prompts_truncated)
    if d.episodes is not None:
        scores = score_episodes(run.task, d.episodes, strict=cfg.strict_rewards, where=f"step {step}")
        counts.episodes = episode_counts(d.episodes, run.episodes.abandoned())
    else:
        scores = score(run.task, owners, out.texts, strict=cfg.strict_rewards, where=f"step {step}")
    counts.reward_errors = scores.errors
    return Sampled(owners, out, scores.rewards, counts, seconds, d.episodes)


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
    seconds = {"generate_s": 0.0, "logprobs_s": 0.0}
    rounds = 0
    while rounds < cfg.dynamic_sampling_rounds and len(kept) < cfg.batch_size:
        d = drawn if rounds == 0 else draw(run, step, step - 1, rounds, cfg.batch_size - len(kept))
        s = score_drawn(run, d, step)
        counts = merge(counts, s.counts)  # prompts_truncated counted here: the rows below are picked per group
        seconds = {k: v + s.seconds[k] for k, v in seconds.items()}
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
                   [r for grp in groups for r in grp.rewards], counts, seconds,
                   None if not is_environment(run.task) else [ep for grp in groups for ep in grp.episodes])


class DrawAhead:
    """max_staleness >= 1: while step s computes its log-probs and learns, a thread draws the rollouts of
    step s+1 from the policy before step s (version s-1), so each batch is one version old when it is
    learned (lag 1; the first step after a start or a resume is drawn synchronously: lag 0).

    The engine is loaded only on the main thread and never while a draw is in flight (`settle` before an
    eval, which loads another version). The task's state from before the in-flight draw's prompts is what a
    checkpoint saves (run.drawn_from), so a resumed run draws those prompts again, from its own policy.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmrl-draw")
        self.pending: tuple[int, concurrent.futures.Future] | None = None  # (step, its draw); rows carry their version

    def submit(self, step: int, version: int) -> None:
        run = self.run
        run.engine.load(run.model, version)
        run.drawn_from[step] = run.task.state_dict()
        self.pending = (step, self.pool.submit(draw, run, step, version))

    def take(self, step: int) -> Drawn | None:
        """The draw of `step` if one is in flight (its errors, e.g. a dead server, raise here)."""
        if self.pending is None or self.pending[0] != step:
            return None
        future, self.pending = self.pending[1], None
        return future.result()

    def settle(self) -> None:
        """Wait until the in-flight draw is done (its result or error stays for `take`)."""
        if self.pending is not None:
            concurrent.futures.wait([self.pending[1]])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def reward_shaping(cfg: TrainConfig, out: Rollout, budget: int | None = None) -> dict[str, torch.Tensor]:
    """Terms added to the task's rewards, by name ([N] each, on the CPU like the rewards, whatever device
    the rollout is on): DAPO's soft overlong penalty on a row's sampled tokens against `budget` (the episode's
    token budget: max_new_tokens for one reply, episode_tokens for an environment's replies together), and
    the KL penalty −kl_coef · Σ_t KL_t when kl_in_reward."""
    terms: dict[str, torch.Tensor] = {}
    if cfg.overlong_buffer > 0:
        terms["overlong"] = overlong_penalty(out.completion_lens.cpu(), budget or cfg.max_new_tokens,
                                             cfg.overlong_buffer, cfg.overlong_penalty)
    if cfg.kl_in_reward:
        per_token = KL_ESTIMATORS[cfg.kl_estimator](out.logp_old, out.logp_ref) * out.completion_mask  # [N, L-1]
        terms["kl_penalty"] = -cfg.kl_coef * per_token.sum(1).float().cpu()
    return terms


def advantages(cfg: TrainConfig, rewards: torch.Tensor) -> torch.Tensor:
    """Step 4 over the global batch (every estimator is exact with any number of ranks): [N] → [N]."""
    adv = ADVANTAGE_ESTIMATORS[cfg.adv_estimator](rewards, cfg.group_size)
    if cfg.normalize_advantages:
        adv = normalize_advantages(adv, cfg.group_size)
    return adv.clamp(-cfg.adv_clip, cfg.adv_clip)


def episode_budget(run: Run) -> int:
    """Sampled tokens a row may hold: max_new_tokens for a single-turn task, the episode's budget (all its
    replies together) for an environment. The overlong penalty and Dr. GRPO's constant are taken against it."""
    return run.episodes.limits.episode_tokens


def update_settings(run: Run) -> UpdateSettings:
    cfg = run.cfg
    return UpdateSettings(
        algo=cfg.algo, loss=dataclasses.replace(cfg.loss_settings, max_tokens=episode_budget(run)), ppo_epochs=cfg.ppo_epochs, minibatch_size=cfg.minibatch_size,
        grad_accum_steps=cfg.grad_accum_steps, kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,
        kl_estimator=cfg.kl_estimator, kl_agg=cfg.kl_agg, max_grad_norm=cfg.max_grad_norm, shared_prefix=run.plan.shared_prefix_update,
        fuse_accumulation=run.plan.fuse_accumulation, token_budget=run.plan.token_budget, mismatch=cfg.mismatch_correction, mismatch_cap=cfg.mismatch_cap,
        engine_old=run.plan.engine_old,
    )


def reward_metrics(rewards: list[Reward], adv: torch.Tensor, rewards_t: torch.Tensor, group_size: int) -> dict[str, float]:
    n = len(rewards)
    out = {"reward/mean": rewards_t.mean().item(), "reward/std": rewards_t.std(unbiased=False).item(),
           "reward/min": rewards_t.min().item(), "reward/max": rewards_t.max().item()}
    for name in dict.fromkeys(k for r in rewards for k in r.components):
        out[f"reward/{name}"] = sum(r.components.get(name, 0.0) for r in rewards) / n
    for name in dict.fromkeys(k for r in rewards for k in r.counts):
        out[f"reward/{name}"] = sum(r.counts.get(name, 0) for r in rewards)
    out |= {"adv/mean": adv.mean().item(), "adv/std": adv.std(unbiased=False).item(),
            "adv/min": adv.min().item(), "adv/max": adv.max().item(),
            "rollout/zero_spread_frac": zero_spread_fraction(rewards_t, group_size)}
    return out


@dataclass
class Gathered:
    """Every rank's share of a step, in rank (= global row) order."""

    owners: list[Example]
    texts: list[str]
    rewards: list[Reward]
    rewards_t: torch.Tensor  # [N] task rewards plus shaping terms
    lengths: torch.Tensor  # [N] completion tokens (EOS included)
    scored: torch.Tensor  # [N] tokens the loss sees (after overlong_filter)
    ended: torch.Tensor  # [N] bool
    counts: Counts  # merged over ranks
    transcripts: list[list[dict[str, str]] | None]  # [N] environments: each episode's messages after the prompt
    first_row: int  # this rank's first global row


def gather(run: Run, s: Sampled, rewards_t: torch.Tensor, lengths: torch.Tensor) -> Gathered:
    """`lengths` [n]: this rank's rows' sampled tokens (before overlong_filter took truncated rows out of the mask)."""
    out = s.rollout
    parts = run.dist.gather({"owners": s.owners, "texts": out.texts, "rewards": s.rewards, "rewards_t": rewards_t,
                             "lengths": lengths, "scored": out.completion_mask.sum(1).cpu(),
                             "ended": out.ended.cpu(), "counts": s.counts,
                             "transcripts": [ep.transcript for ep in s.episodes] if s.episodes else [None] * len(s.owners)})
    return Gathered(
        owners=[o for p in parts for o in p["owners"]], texts=[t for p in parts for t in p["texts"]],
        rewards=[r for p in parts for r in p["rewards"]], rewards_t=torch.cat([p["rewards_t"] for p in parts]),
        lengths=torch.cat([p["lengths"] for p in parts]), scored=torch.cat([p["scored"] for p in parts]),
        ended=torch.cat([p["ended"] for p in parts]), counts=functools.reduce(merge, [p["counts"] for p in parts]),
        transcripts=[t for p in parts for t in p["transcripts"]],
        first_row=sum(len(p["rewards"]) for p in parts[: run.dist.rank]),
    )


def step_record(run: Run, g: Gathered, adv: torch.Tensor, stats: UpdateStats, train: dict[str, float],
                rollout_s: float, update_s: float, seconds: dict[str, float]) -> dict[str, Any]:
    """Add the step to run.totals and return its metrics.jsonl record (without "step"). `seconds`: the
    parts of rollout_s (generate_s, logprobs_s) on this rank."""
    cfg, totals = run.cfg, run.totals
    totals.bad_in_a_row = stats.trailing_skips if stats.optimizer_steps else totals.bad_in_a_row + stats.skipped_updates
    totals.optimizer_steps += stats.optimizer_steps
    totals.skipped_updates += stats.skipped_updates + stats.empty_minibatches
    totals.empty_minibatches += stats.empty_minibatches
    totals.reward_errors += g.counts.reward_errors
    totals.prompts_skipped += g.counts.prompts_skipped
    totals.completions += len(g.rewards)
    totals.train_seconds += rollout_s + update_s
    lengths = g.lengths.float()
    metrics = {
        **reward_metrics(g.rewards, adv, g.rewards_t, cfg.group_size),
        **train,
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
        "time/rollout_s": rollout_s,
        **{f"time/{k}": v for k, v in seconds.items()},
        "time/update_s": update_s,
        "time/train_s": totals.train_seconds,
    }
    return metrics


def shaped_rewards(cfg: TrainConfig, s: Sampled, budget: int) -> torch.Tensor:
    """The task rewards plus the shaping terms [n] (each also logged as a reward component); with
    overlong_filter, truncated completions (an episode's last reply cut by a token cap) leave the
    completion mask (they teach nothing)."""
    rewards_t = torch.tensor([r.total for r in s.rewards], dtype=torch.float32)
    for name, values in reward_shaping(cfg, s.rollout, budget).items():
        rewards_t += values
        for r, v in zip(s.rewards, values.tolist()):
            r.components[name] = v
    if cfg.overlong_filter:
        s.rollout.completion_mask[~s.rollout.ended] = 0.0
    return rewards_t


def spans(out: Rollout) -> torch.Tensor:
    """[n] each row's columns after the prompt block up to its last scored token (0 when none): its scored
    tokens for one reply, more for an episode (environment tokens lie between its replies)."""
    mask = out.completion_mask  # [n, L-1]: column P-1+j scores trajectory token j
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return ((mask > 0) * cols).amax(1).sub(out.prompt_len - 1).clamp(min=0)


def update(run: Run, out: Rollout, g: Gathered, adv: torch.Tensor) -> tuple[UpdateStats, dict[str, float]]:
    """Step 5 on this rank's rows; returns the stats and the train/ metrics averaged over ranks."""
    n, device = out.input_ids.shape[0], out.input_ids.device
    batch = UpdateBatch(
        input_ids=out.input_ids, attention_mask=out.attention_mask, completion_mask=out.completion_mask,
        logp_old=out.logp_old, logp_ref=out.logp_ref, adv=adv[g.first_row : g.first_row + n].to(device),
        group=torch.arange(n, device=device) // run.cfg.group_size, prompt_len=out.prompt_len,
        lengths=g.scored.to(device), offset=g.first_row, logp_engine=out.engine_logp, spans=spans(out),
    )
    stats = policy_update(run.model, run.optimizer, batch, update_settings(run), run.shuffle, run.dist)
    train = stats.logged()
    if out.entropy is not None:  # the sampling policy's, T = 1 (not with old_logprobs=engine: vLLM returns no entropies)
        train["train/entropy"] = masked_mean(out.entropy, out.completion_mask).item()
    diff = None  # (Σ|engine − trainer|, tokens, max) of the sampled tokens' log-probs at θ_old, vllm only
    if out.engine_logp is not None:
        diff = (stats.engine_diff if run.plan.engine_old
                else add_diff(None, out.logp_old, out.engine_logp, out.completion_mask)) or (0.0, 0.0, 0.0)
    averaged = (*(f"train/{k}" for k in stats.MEAN_FIELDS), "train/entropy")
    every_rank = run.dist.gather((train, diff))  # one collective for all the statistics
    train = {k: sum(r[k] for r, _ in every_rank) / run.dist.world if k in averaged else v for k, v in train.items()}
    if diff is not None:
        # rows drawn from the policy the trainer holds: the engine's mismatch alone; rows a version behind
        # (async): the policy's change since, plus the mismatch, under another name
        lagged = out.version is not None and bool((out.version < run.learned).any())
        name = "rollout/lagged_logprob_diff" if lagged else "rollout/engine_logprob_diff"
        sums = [d for _, d in every_rank]
        train[name] = sum(d[0] for d in sums) / max(sum(d[1] for d in sums), 1.0)
        train[f"{name}_max"] = max(d[2] for d in sums)
    return stats, train


@dataclass
class Collected:
    """What `collect` hands to `learn`: this rank's rows and rewards, the global batch, its advantages."""

    sampled: Sampled  # this rank's rows (Rollout), rewards, episodes
    batch: Gathered  # every rank's rewards, lengths, texts
    adv: torch.Tensor  # [N] global advantages
    rollout_s: float  # the rollout's wall time on this rank (sampling, old/ref log-probs, rewards)


def collect(run: Run, step: int, ahead: DrawAhead | None = None) -> Collected:
    """Steps 1-4: prompts, G rollouts each, rewards, advantages. The rollouts come from the policy before
    this step (version step-1), or, with `ahead` (max_staleness), from the draw it made during the step
    before (version step-2: max_staleness 1)."""
    cfg = run.cfg
    t0 = time.perf_counter()
    drawn = ahead.take(step) if ahead else None
    if drawn is None:
        run.engine.load(run.model, step - 1)  # vllm: the adapter (counted in generate_s)
        load_s = time.perf_counter() - t0
        run.drawn_from.setdefault(step, run.task.state_dict())
        drawn = draw(run, step, step - 1)
        drawn.generate_s += load_s
    if ahead and step < cfg.steps:
        ahead.submit(step + 1, step - 1)  # drawn while this step learns
    s = sample_and_score(run, step, drawn)
    if run.plan.one_ahead:
        lag = (step - 1) - s.rollout.version
        s.counts.lag = LagCounts(lag_sum=int(lag.sum()), rows=len(lag), lag_max=int(lag.max()))
    lengths = s.rollout.completion_lens.cpu()  # sampled tokens, before overlong_filter masks truncated rows
    rewards_t = shaped_rewards(cfg, s, episode_budget(run))
    rollout_s = time.perf_counter() - t0
    g = gather(run, s, rewards_t, lengths)
    return Collected(s, g, advantages(cfg, g.rewards_t), rollout_s)


def learn(run: Run, c: Collected, step: int) -> tuple[UpdateStats, dict[str, float], float]:
    """Step 5 on collected rows, with step's learning rate: (stats, train/ metrics, seconds)."""
    for group in run.optimizer.param_groups:  # warmup counted in RL steps, as the starter does
        group["lr"] = run.cfg.lr * warmup_factor(step - 1, run.cfg.warmup_steps)
    t0 = time.perf_counter()
    stats, train = update(run, c.sampled.rollout, c.batch, c.adv)
    return stats, train, time.perf_counter() - t0


def train_step(run: Run, step: int, ahead: DrawAhead | None = None) -> StepResult:
    """RL step `step` (1-based): collect, then learn; returns what to log. Updates run.totals."""
    c = collect(run, step, ahead)  # 1-4. prompts, rollouts, rewards, advantages
    stats, train, update_s = learn(run, c, step)  # 5. the update
    run.learned = step
    run.drawn_from.pop(step, None)  # learned: a checkpoint no longer needs the task's state from before its prompts
    g, adv = c.batch, c.adv
    metrics = step_record(run, g, adv, stats, train, c.rollout_s, update_s, c.sampled.seconds)
    samples = []
    if run.cfg.sample_log_interval and step % run.cfg.sample_log_interval == 0:
        samples = [{"prompt": ex.messages[-1]["content"] if ex.messages else "", "answer": ex.answer, "completion": text, "reward": r.total,
                    "components": r.components, "advantage": a, "ended": bool(e),
                    **({"transcript": t} if t is not None else {})}
                   for ex, text, r, a, e, t in zip(g.owners, g.texts, g.rewards, adv.tolist(), g.ended.tolist(), g.transcripts)]
    return StepResult(metrics, samples)
