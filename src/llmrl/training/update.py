"""The policy update of one RL step: minibatches, losses, gradient accumulation, optimizer steps."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from llmrl.algorithms.core import (
    KL_ESTIMATORS, MISMATCH_REMOVES_ROWS, mismatch_loss_mask, mismatch_weights,
)
from llmrl.algorithms.losses import AGGREGATIONS, LOSSES, LossSettings
from llmrl.models.scoring import sequence_logprobs, shared_prefix_logprobs
from llmrl.training.distributed import Dist, all_reduce_grads
from llmrl.training.fsdp import held_bytes, is_sharded, total_norm, zero_backward


def warmup_factor(rl_step: int, warmup_steps: int) -> float:
    """LR multiplier of 0-based RL step `rl_step` (the starter's unit; the same for every optimizer step
    inside that RL step): linear from 1/warmup at step 0 to 1 from step warmup-1 on."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (rl_step + 1) / warmup_steps)


@dataclass(frozen=True)
class UpdateSettings:
    """How one rollout updates the policy (the config's update fields and the plan's speed paths)."""

    algo: str  # LOSSES key
    loss: LossSettings
    ppo_epochs: int
    minibatch_size: int
    grad_accum_steps: int
    kl_coef: float  # 0: no KL term, and the batch needs no logp_ref
    kl_estimator: str  # KL_ESTIMATORS key
    max_grad_norm: float
    kl_agg: str = "token_mean"  # the KL term's average: token_mean (seed) or loss_agg (as the policy term)
    shared_prefix: bool = False  # rows with the same `group` run their prompt once
    fuse_accumulation: bool = False  # one forward per optimizer window instead of one per minibatch ...
    token_budget: int = 2**62  # ... when the window's padded rows × columns fit this; a minibatch over it
    #   runs as several forwards of length-sorted rows (activation and logit memory at long completions)
    mismatch: str = "none"  # training-inference mismatch correction (core.mismatch_weights); needs logp_engine
    mismatch_cap: float = 2.0
    engine_old: bool = False  # logp_old is the engine's (old_logprobs=engine): correct the loss's own ratio


@dataclass
class UpdateBatch:
    """This rank's rows of one rollout: global rows [offset, offset + n) of the step's N."""

    input_ids: torch.Tensor  # [n, L]
    attention_mask: torch.Tensor  # [n, L]
    completion_mask: torch.Tensor  # [n, L-1]
    logp_old: torch.Tensor  # [n, L-1]
    logp_ref: torch.Tensor | None  # [n, L-1], None when kl_coef = 0
    adv: torch.Tensor  # [n] advantages, already clipped
    group: torch.Tensor  # [n] prompt index of each row (shared-prefix forwards)
    prompt_len: int
    lengths: torch.Tensor  # [N] scored completion tokens of every global row (all ranks)
    offset: int = 0
    logp_engine: torch.Tensor | None = None  # [n, L-1] the rollout engine's log-probs (vllm), else None
    spans: torch.Tensor | None = None  # [n] this rank's rows: columns after the prompt block up to the last scored
    #   token (a multi-turn row holds environment tokens between its replies); None: `lengths` (one reply each)


@dataclass
class UpdateStats:
    """What one update did. Means over minibatches (averaged over ranks too: MEAN_FIELDS) and counts."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    clip_frac_low: float = 0.0
    clip_frac_high: float = 0.0
    grad_norm: float = float("nan")  # mean over optimizer steps taken
    lr: float = float("nan")
    optimizer_steps: int = 0
    skipped_updates: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm
    trailing_skips: int = 0  # of those, how many since the last step taken
    empty_minibatches: int = 0  # minibatches without completion tokens (no forward, not accumulated)
    engine_diff: tuple[float, float, float] | None = None  # old_logprobs=engine: (Σ|Δ|, tokens, max |Δ|) of the
    #   trainer's log-probs before the first optimizer step (training forward: LoRA dropout on) vs the
    #   engine's, over this rank's first window (the step fills it in for other vLLM runs, and sums it over ranks)
    entropy: float | None = None  # the step's: the sampling policy's mean token entropy (hf engine)
    lagged: bool = False  # the rows were drawn by an older policy than the one updated (async)
    state_mb: float | None = None  # this rank's trained parameters + gradients + optimizer state at an optimizer step

    MEAN_FIELDS = ("loss", "pg_loss", "kl", "clip_frac", "clip_frac_low", "clip_frac_high")


def trim_to_completions(mb: dict[str, torch.Tensor], prompt_len: int) -> dict[str, torch.Tensor]:
    """Drop trailing columns where no row of the minibatch has a completion token left to score.

    Sequence tensors are [M, L]; per-token tensors [M, L-1]; per-row tensors [M] are kept as they are.
    """
    mask = mb["completion_mask"]  # [M, L-1]
    scored = mask.sum(0).nonzero()
    last = int(scored.max()) + 1 if len(scored) else prompt_len  # keep logp columns [0, last)
    out = {}
    for k, v in mb.items():
        if v.dim() == 2:
            out[k] = v[:, : last + 1] if v.shape[1] == mask.shape[1] + 1 else v[:, :last]
        else:
            out[k] = v
    return out


def add_diff(acc: tuple[float, float, float] | None, a: torch.Tensor, b: torch.Tensor,
             mask: torch.Tensor) -> tuple[float, float, float]:
    """(Σ|a − b|, tokens, max |a − b|) over the mask, added to `acc`: a, b, mask [M, T]."""
    d = (a.detach() - b).abs() * mask
    s, n, m = acc or (0.0, 0.0, 0.0)
    return s + d.sum().item(), n + mask.sum().item(), max(m, d.max().item() if d.numel() else 0.0)


def share_of(aggregate: str, piece: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> float:
    """The weight of a forward over global rows `piece` in a mean over the minibatch `rows`: its share of
    the tokens for a token mean, of the rows for the per-sequence means."""
    if aggregate == "token_mean":
        return 1.0 if len(piece) == len(rows) else (lengths[piece].sum() / lengths[rows].sum().clamp(min=1)).item()
    return len(piece) / len(rows)


def widths(rows: torch.Tensor, batch: UpdateBatch) -> torch.Tensor:
    """[M] columns after the prompt block that a forward over global `rows` (this rank's) needs for each."""
    return batch.lengths[rows] if batch.spans is None else batch.spans[rows - batch.offset]


def padded_tokens(rows: torch.Tensor, batch: UpdateBatch) -> int:
    """Rows × columns one forward over global `rows` (this rank's) runs: the prompt block plus the
    widest row's columns up to its last scored token (environment tokens included)."""
    longest = int(widths(rows, batch).max()) if len(rows) else 0
    return len(rows) * (batch.prompt_len + longest)


def budget_pieces(rows: torch.Tensor, batch: UpdateBatch, token_budget: int) -> list[torch.Tensor]:
    """Split this rank's `rows` [M] of one minibatch into forwards of at most `token_budget` padded
    tokens where possible (one row always runs): all of them, in order, when they fit; else sorted
    longest first (each forward pads to rows of similar length) and cut into the fewest pieces of
    near-equal row counts that fit. The pieces partition `rows`."""
    if padded_tokens(rows, batch) <= token_budget:
        return [rows]
    ordered = rows[torch.argsort(widths(rows, batch), descending=True, stable=True)]
    for k in range(2, len(ordered) + 1):
        pieces = list(ordered.tensor_split(k))
        if all(padded_tokens(p, batch) <= token_budget for p in pieces):
            return pieces
    return list(ordered.tensor_split(len(ordered)))


def window_forwards(window: list[torch.Tensor], batch: UpdateBatch, fuse: bool,
                    token_budget: int) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The forwards of one optimizer window (global row ids per minibatch), each a list of
    (minibatch rows, this rank's rows of it, the rows of those this forward runs): with `fuse` and
    within the budget, one forward for the whole window; otherwise each minibatch alone, in
    `budget_pieces` when it is over the budget. Minibatches without rows on this rank are left out."""
    n = batch.adv.shape[0]
    owns = [(rows, rows[(rows >= batch.offset) & (rows < batch.offset + n)]) for rows in window]
    owns = [(rows, own) for rows, own in owns if len(own)]
    if not owns:
        return []
    if fuse and padded_tokens(torch.cat([own for _, own in owns]), batch) <= token_budget:
        return [[(rows, own, own) for rows, own in owns]]
    return [[(rows, own, piece)] for rows, own in owns for piece in budget_pieces(own, batch, token_budget)]


def accumulation_windows(minibatch_rows: list[torch.Tensor], lengths: torch.Tensor,
                         grad_accum_steps: int) -> tuple[list[list[torch.Tensor]], int]:
    """Group the update's minibatches (all epochs, in order) into optimizer steps, as the starter does.

    minibatch_rows: global row indices of each minibatch; lengths [N]: scored completion tokens per row.
    A minibatch with no completion token is skipped (no forward, no step) and does not count towards
    accumulation; the others form windows of `grad_accum_steps`, the last one possibly shorter.
    Returns (windows, number of minibatches skipped).
    """
    scored = [rows for rows in minibatch_rows if lengths[rows].sum() > 0]
    windows = [scored[i : i + grad_accum_steps] for i in range(0, len(scored), grad_accum_steps)]
    return windows, len(minibatch_rows) - len(scored)


def policy_update(model, optimizer: torch.optim.Optimizer, batch: UpdateBatch, s: UpdateSettings,
                  generator: torch.Generator, dist: Dist | None = None) -> UpdateStats:
    """Run `ppo_epochs` passes of minibatch updates over one rollout.

    Minibatches are drawn from a permutation of all N global rows per epoch (the same on every rank);
    each rank computes its rows' share, weighted by its share of the minibatch's rows (or tokens, for
    token means), and the ranks' gradients are summed. loss = (pg + kl_coef·KL) / grad_accum_steps,
    KL = KL_ESTIMATORS[kl_estimator] averaged as a token mean or by the policy term's aggregation (kl_agg);
    the minibatches of all epochs, in order, are accumulated into optimizer steps (accumulation_windows: empty ones skipped, a remainder flushed at
    the end). One forward per minibatch, or per window with fuse_accumulation (bigger matmuls, each
    prompt once per window), within token_budget padded tokens (`window_forwards`: a minibatch over it
    runs in pieces); the same losses and gradients either way. A non-finite loss or gradient
    norm skips that optimizer step. The learning rate is the optimizer's, as set by the caller.
    """
    dist = dist or Dist()
    sharded = is_sharded(model)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn, kl_fn = LOSSES[s.algo], KL_ESTIMATORS[s.kl_estimator]
    lengths = batch.lengths
    stats = UpdateStats()
    sums = dict.fromkeys(UpdateStats.MEAN_FIELDS, 0.0)
    grad_norms: list[float] = []
    minibatches = 0
    model.train()
    optimizer.zero_grad(set_to_none=True)
    per_row = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}  # this rank's [n, ...] tensors
    per_row = {k: v for k, v in per_row.items() if torch.is_tensor(v) and k not in ("lengths", "spans")}

    minibatch_rows = [rows for _epoch in range(s.ppo_epochs)
                      for rows in torch.randperm(len(lengths), generator=generator).split(s.minibatch_size)]
    windows, stats.empty_minibatches = accumulation_windows(minibatch_rows, lengths, s.grad_accum_steps)
    for window in windows:  # one optimizer step per window
        bad = False
        chunks = window_forwards(window, batch, s.fuse_accumulation, s.token_budget)
        minibatches += len({id(rows) for chunk in chunks for rows, _, _ in chunk})  # those with rows on this rank
        for chunk in chunks:
            idx = torch.cat([piece for _, _, piece in chunk]).to(batch.adv.device) - batch.offset  # this rank's rows
            tensors = trim_to_completions({k: v[idx] for k, v in per_row.items()}, batch.prompt_len)
            if s.shared_prefix:  # logp_new [M, T]
                logp = shared_prefix_logprobs(model, tensors["input_ids"], tensors["attention_mask"], batch.prompt_len,
                                              tensors["group"])[0]
            else:
                logp = sequence_logprobs(model, tensors["input_ids"], tensors["attention_mask"], batch.prompt_len)[0]
            chunk_loss, start = 0.0, 0
            for rows, own, piece in chunk:
                part = slice(start, start + len(piece))  # these rows of the chunk's forward
                start += len(piece)
                mb = {k: v[part] for k, v in tensors.items()}
                weight = None
                if s.engine_old and stats.optimizer_steps + stats.skipped_updates == 0:  # θ is still θ_old
                    stats.engine_diff = add_diff(stats.engine_diff, logp[part], mb["logp_old"], mb["completion_mask"])
                if s.mismatch in MISMATCH_REMOVES_ROWS:  # verl's rejection: rows leave the mask the loss and KL average
                    x = (logp[part].detach() if s.engine_old else mb["logp_old"]) - mb["logp_engine"]
                    mb["completion_mask"] = mismatch_loss_mask(x, mb["completion_mask"], s.mismatch, s.mismatch_cap)
                if s.mismatch != "none":
                    proximal = logp[part].detach() if s.engine_old else mb["logp_old"]
                    weight = mismatch_weights(proximal - mb["logp_engine"], mb["completion_mask"], s.mismatch,
                                              s.mismatch_cap, in_ratio=s.engine_old and s.algo == "grpo")
                pg, parts = loss_fn(logp[part], mb["logp_old"], mb["adv"], mb["completion_mask"], s.loss, weight)
                kl_agg = "token_mean" if s.kl_agg == "token_mean" else s.loss.aggregate
                # the KL term: a token mean (the seed's, whatever the policy term's aggregation), or the policy's
                # aggregation, loss_agg (TRL adds β·kl_t to the per-token loss; verl's kl_loss uses loss_agg_mode)
                kl = torch.zeros((), device=pg.device)
                if s.kl_coef > 0:
                    kl = AGGREGATIONS[kl_agg](kl_fn(logp[part], mb["logp_ref"]), mb["completion_mask"], s.loss.max_tokens)
                # this forward's share of the minibatch's loss (1 in one process, unless split by the budget)
                pg_share = share_of(s.loss.aggregate, piece, rows, lengths)
                kl_share = share_of(kl_agg, piece, rows, lengths)
                loss = (pg * pg_share + s.kl_coef * kl * kl_share) / s.grad_accum_steps
                bad = bad or not bool(torch.isfinite(loss))
                chunk_loss = chunk_loss + loss
                # logged means are this rank's: weight a piece by its share of the rank's rows (or tokens)
                pg_w, kl_w = share_of(s.loss.aggregate, piece, own, lengths), share_of(kl_agg, piece, own, lengths)
                sums["loss"] += (pg * pg_w + s.kl_coef * kl * kl_w).item()
                sums["pg_loss"] += pg_w * pg.item()
                sums["kl"] += kl_w * kl.item()
                tok_w = share_of("token_mean", piece, own, lengths)
                for key in ("clip_frac", "clip_frac_low", "clip_frac_high"):
                    sums[key] += tok_w * parts.get(key, 0.0)
            if not bad:
                chunk_loss.backward()
            elif sharded:
                zero_backward(model)  # FSDP2: every rank runs the window's reduce-scatters
        if sharded:  # gradients already summed into each rank's shard; every rank runs as many backwards
            for _ in range(max(dist.gather(len(chunks))) - len(chunks)):
                zero_backward(model)
            bad = dist.any(bad)
        else:
            bad = all_reduce_grads(params, bad, dist)
        norm = total_norm(torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm))
        if bad or not math.isfinite(norm):
            stats.skipped_updates += 1
            stats.trailing_skips += 1
        else:
            stats.trailing_skips = 0
            optimizer.step()
            stats.state_mb = held_bytes(params, optimizer) / 2**20  # gradients and AdamW state all exist now
            stats.optimizer_steps += 1
            grad_norms.append(norm)
        optimizer.zero_grad(set_to_none=True)
    for key, total in sums.items():
        setattr(stats, key, total / max(minibatches, 1))
    stats.grad_norm = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    stats.lr = optimizer.param_groups[0]["lr"]
    return stats
