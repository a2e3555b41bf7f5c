"""Policy-gradient losses, one small function per algorithm, chosen by name from `LOSSES`.

Every loss takes per-token tensors restricted to one minibatch and returns (pg_loss, stats):
    logp_new [M, T]  log-probs under the policy being trained (with grad)
    logp_old [M, T]  log-probs under the behaviour policy at sampling time (no grad)
    adv      [M]     per-sequence advantages (already clipped)
    mask     [M, T]  completion mask
`stats` holds detached scalars for logging (e.g. the clip fraction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmrl.algorithms.core import LOG_RATIO_CLAMP, masked_mean, masked_mean_rows

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def reinforce_loss(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative REINFORCE: pg = −mean_i(A_i · masked_row_mean(logp_new_i)).

    `logp_old` and `clip_eps` are unused (one on-policy pass); the signature matches the table.
    """
    seq_logp = masked_mean_rows(logp_new, mask)  # [M]
    return -(adv * seq_logp).mean(), {"clip_frac": 0.0}


def grpo_loss(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO / PPO-clip: per token min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) with ρ = exp(new − old),
    masked row mean, pg = −mean over sequences.

    clip_frac is the fraction of completion tokens where the clipped term is the one chosen
    (i.e. the gradient is cut off).
    """
    ratio = torch.exp((logp_new - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [M, T]
    a = adv[:, None]  # [M, 1]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * a
    per_token = torch.minimum(unclipped, clipped)  # [M, T]
    pg = -masked_mean_rows(per_token, mask).mean()
    clip_frac = masked_mean((clipped < unclipped).float(), mask).item()
    return pg, {"clip_frac": clip_frac}


LOSSES: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "reinforce": reinforce_loss,
}
