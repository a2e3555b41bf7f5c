"""Policy-gradient losses, each variant a small function chosen by name from a table.

    LOSSES[algo]         grpo (clipped surrogate) | reinforce (plain policy gradient)
    RATIOS[ratio_level]  token (PPO/GRPO) | sequence (GSPO)
    AGGREGATIONS[loss_agg]  seq_mean_token_mean (seed) | token_mean (DAPO) | seq_mean_token_sum (Dr. GRPO)

Every loss takes per-token tensors restricted to one minibatch and returns (pg_loss, stats):
    logp_new [M, T]  log-probs under the policy being trained (with grad)
    logp_old [M, T]  log-probs under the behaviour policy at sampling time (no grad)
    adv      [M]     per-sequence advantages (already clipped)
    mask     [M, T]  completion mask
    weight   [M, T]  optional detached per-token weights (training-inference mismatch correction,
                     core.mismatch_weights); None = 1
`stats` holds detached scalars for logging (clip fractions on the low and high side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmrl.algorithms.core import EPS_MASK, LOG_RATIO_CLAMP, masked_mean, masked_mean_rows


# ----------------------------------------------------------------------------- aggregation: [M, T] -> scalar


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The seed's: mean over sequences of each sequence's token mean (short answers weigh more per token)."""
    return masked_mean_rows(x, mask).mean()


def token_mean(x: torch.Tensor, mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """DAPO: one mean over every completion token of the minibatch (each token weighs the same)."""
    return masked_mean(x, mask)


def seq_mean_token_sum(x: torch.Tensor, mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Dr. GRPO: each sequence's token sum divided by a constant (the generation budget
    max_new_tokens), then the mean over sequences: no length bias from the normaliser."""
    return ((x * mask).sum(1) / max_tokens).mean()


Aggregation = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": seq_mean_token_mean,
    "token_mean": token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
}


# ----------------------------------------------------------------------------- importance ratios: [M, T] -> [M, T]


def token_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO/GRPO: ρ_t = π(y_t)/π_old(y_t) per token."""
    return torch.exp((logp_new - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def sequence_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: s = (π(y)/π_old(y))^(1/|y|) = exp(mean_t(new − old)), one ratio per sequence, broadcast
    to its tokens (so clipping keeps or drops whole sequences)."""
    log_s = masked_mean_rows(logp_new - logp_old, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [M]
    return torch.exp(log_s)[:, None].expand_as(logp_new)


RATIOS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": token_ratio,
    "sequence": sequence_ratio,
}


# ----------------------------------------------------------------------------- losses


@dataclass(frozen=True)
class LossSettings:
    """How a loss is computed: clip range [1 − clip_low, 1 + clip_high], ratio level, aggregation."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio: str = "token"
    aggregate: str = "seq_mean_token_mean"
    max_tokens: int = 1  # the constant of seq_mean_token_sum


def reinforce_loss(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, s: LossSettings,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative REINFORCE: pg = −aggregate(w_it · A_i · logp_new_it). With the seed's aggregation and
    no weights this is −mean_i(A_i · masked_row_mean(logp_new_i)). `logp_old` is unused (one on-policy pass)."""
    per_token = adv[:, None] * logp_new  # [M, T]
    if weight is not None:
        per_token = per_token * weight
    return -AGGREGATIONS[s.aggregate](per_token, mask, s.max_tokens), {"clip_frac": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0}


def grpo_loss(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, s: LossSettings,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO / PPO-clip: min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) per token, pg = −aggregate(…).

    ρ is RATIOS[s.ratio] (token: PPO; sequence: GSPO). With ε_high > ε_low this is DAPO's clip-higher.
    clip_frac_low / clip_frac_high: fraction of completion tokens where the clipped term is chosen
    because ρ < 1 − ε_low (A < 0) or ρ > 1 + ε_high (A > 0), i.e. where the gradient is cut off.
    `weight` multiplies each token's term before aggregation.
    """
    ratio = RATIOS[s.ratio](logp_new, logp_old, mask)  # [M, T]
    a = adv[:, None]  # [M, 1]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * a
    per_token = torch.minimum(unclipped, clipped)  # [M, T]
    if weight is not None:
        per_token = per_token * weight
    pg = -AGGREGATIONS[s.aggregate](per_token, mask, s.max_tokens)
    cut = clipped < unclipped
    low = masked_mean((cut & (ratio < 1 - s.clip_low)).float(), mask).item()
    high = masked_mean((cut & (ratio > 1 + s.clip_high)).float(), mask).item()
    return pg, {"clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high}


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "reinforce": reinforce_loss,
}

__all__ = ["AGGREGATIONS", "EPS_MASK", "LOSSES", "LossSettings", "RATIOS", "grpo_loss", "reinforce_loss"]
