"""The policy update of one RL step: minibatches, losses, gradient accumulation, optimizer steps."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from llmrl.algorithms.core import KL_ESTIMATORS, masked_mean
from llmrl.algorithms.losses import LossFn, LossSettings
from llmrl.rollout.sampler import sequence_logprobs, shared_prefix_logprobs
from llmrl.training.distributed import Dist, all_reduce_grads


def warmup_factor(rl_step: int, warmup_steps: int) -> float:
    """LR multiplier of 0-based RL step `rl_step` (the starter's unit; the same for every optimizer step
    inside that RL step): linear from 1/warmup at step 0 to 1 from step warmup-1 on."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (rl_step + 1) / warmup_steps)


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


def iter_minibatches(
    batch: dict[str, torch.Tensor], size: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Shuffle rows with `generator` and yield minibatches of `size` rows (the last may be smaller).

    Every tensor in `batch` has the same first dimension N and is sliced with the same indices.
    """
    n = next(iter(batch.values())).shape[0]
    order = torch.randperm(n, generator=generator)
    for start in range(0, n, size):
        idx = order[start : start + size]
        yield {k: v[idx.to(v.device)] for k, v in batch.items()}


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


def policy_update(
    model, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], *, prompt_len: int,
    loss_fn: LossFn, ppo_epochs: int, minibatch_size: int, grad_accum_steps: int, loss_settings: LossSettings,
    kl_coef: float, max_grad_norm: float, generator: torch.Generator, kl_estimator: str = "k3",
    dist: Dist | None = None, offset: int = 0, lengths: torch.Tensor | None = None, shared_prefix: bool = False,
    fuse_accumulation: bool = False,
) -> dict[str, float]:
    """Run `ppo_epochs` passes of minibatch updates over one rollout.

    batch: input_ids, attention_mask [n, L]; completion_mask, logp_old, (logp_ref) [n, L-1]; adv [n]:
    this rank's rows, global rows [offset, offset + n) of the step's N (one process: all of them).
    Minibatches are drawn from a permutation of all N global rows (same on every rank); each rank
    computes its rows' share, weighted by its share of the minibatch's rows (or tokens, for token
    means; `lengths` [N] holds every row's completion tokens), and the ranks' gradients are summed.
    loss = (pg + kl_coef·KL) / grad_accum_steps, KL the token mean of KL_ESTIMATORS[kl_estimator]
    (kl_coef 0: no KL term, and the batch needs no logp_ref); the minibatches of all epochs, in order,
    are accumulated into optimizer steps (see accumulation_windows: empty ones skipped, a remainder
    flushed at the end). A non-finite loss or gradient norm skips that optimizer step (counted in
    `skipped_updates`). The learning rate is the optimizer's as set by the caller.
    Returns means over minibatches of loss, pg, kl, clip fractions; grad_norm mean over steps; lr;
    counts of optimizer steps taken and skipped, of skips since the last step taken, and of
    minibatches skipped for having no completion token (`empty_minibatches`). shared_prefix: rows with the same batch["group"] run their prompt once.
    fuse_accumulation: the minibatches of one optimizer step share one forward (bigger matmuls, each
    prompt once per window; same losses and gradients, grad_accum_steps× the activation memory).
    """
    dist = dist or Dist()
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "clip_frac_low": 0.0,
                              "clip_frac_high": 0.0}
    kl_fn = KL_ESTIMATORS[kl_estimator]
    n_local = batch["adv"].shape[0]
    lengths = batch["completion_mask"].sum(1) if lengths is None else lengths  # [N] tokens per global row
    n_global = lengths.shape[0]
    by_tokens = loss_settings.aggregate == "token_mean"
    grad_norms: list[float] = []
    minibatches = optimizer_steps = skipped = trailing = 0  # trailing: skips since the last step taken
    model.train()
    optimizer.zero_grad(set_to_none=True)

    def forward(rows: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's rows among global `rows`: (their trimmed batch, logp_new)."""
        mb = trim_to_completions({k: v[(rows - offset).to(batch["adv"].device)] for k, v in batch.items()}, prompt_len)
        if shared_prefix:
            logp = shared_prefix_logprobs(model, mb["input_ids"], mb["attention_mask"], prompt_len, mb["group"])[0]
        else:
            logp = sequence_logprobs(model, mb["input_ids"], mb["attention_mask"], prompt_len)[0]
        return mb, logp

    minibatch_rows = [rows for _epoch in range(ppo_epochs)
                      for rows in torch.randperm(n_global, generator=generator).split(minibatch_size)]  # global rows
    windows, empty = accumulation_windows(minibatch_rows, lengths, grad_accum_steps)
    for window in windows:  # one optimizer step per window
        owns = [rows[(rows >= offset) & (rows < offset + n_local)] for rows in window]
        fused = forward(torch.cat(owns)) if fuse_accumulation and any(len(o) for o in owns) else None
        bad, start, window_loss = False, 0, 0.0
        for rows, own in zip(window, owns):
            if not len(own):
                continue
            if fused is not None:  # this minibatch's slice of the window's one forward
                part = slice(start, start + len(own))
                start += len(own)
                mb = {k: v[part] for k, v in fused[0].items()}
                logp_new = fused[1][part]
            else:
                mb, logp_new = forward(own)
            row_share = len(own) / len(rows)  # 1 in one process
            token_share = (lengths[own].sum() / lengths[rows].sum().clamp(min=1)).item()
            mask = mb["completion_mask"]
            pg, stats = loss_fn(logp_new, mb["logp_old"], mb["adv"], mask, loss_settings)
            kl = masked_mean(kl_fn(logp_new, mb["logp_ref"]), mask) if kl_coef > 0 else torch.zeros((), device=pg.device)
            loss = (pg * (token_share if by_tokens else row_share) + kl_coef * kl * token_share) / grad_accum_steps
            if not torch.isfinite(loss):
                bad = True
            elif fused is not None:
                window_loss = window_loss + loss  # one backward through the window's forward, below
            else:
                loss.backward()
            minibatches += 1
            sums["loss"] += (pg + kl_coef * kl).item()
            sums["pg_loss"] += pg.item()
            sums["kl"] += kl.item()
            for key in ("clip_frac", "clip_frac_low", "clip_frac_high"):
                sums[key] += stats.get(key, 0.0)
        if fused is not None and not bad and torch.is_tensor(window_loss):
            window_loss.backward()
        bad = all_reduce_grads(params, bad, dist)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        if bad or not math.isfinite(norm):
            skipped += 1
            trailing += 1
        else:
            trailing = 0
            optimizer.step()
            optimizer_steps += 1
            grad_norms.append(norm)
        optimizer.zero_grad(set_to_none=True)
    out = {k: v / max(minibatches, 1) for k, v in sums.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    out["lr"] = optimizer.param_groups[0]["lr"]
    out["optimizer_steps"] = optimizer_steps
    out["skipped_updates"] = skipped
    out["trailing_skips"] = trailing
    out["empty_minibatches"] = empty
    return out
