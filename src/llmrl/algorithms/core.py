"""Pure tensor functions of one RL step: log-probs, masks, means, KL, advantages.

Shapes: N completions (prompt-major: the G completions of prompt 0, then of prompt 1, ...),
L tokens per sequence (prompt left-padded + completion), so per-token quantities are [N, L-1]:
entry t scores token t+1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

EPS_MASK = 1e-8  # keeps masked means finite for rows with no tokens
EPS_STD = 1e-6  # keeps group z-scores finite when the spread is tiny
LOG_RATIO_CLAMP = 20.0  # exp(±20) is finite in fp32; beyond that the estimate is meaningless anyway


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target under its logits: logits [N, T, V], targets [N, T] → [N, T] float32.
    Uses cross-entropy so no [N, T, V] log-softmax is kept."""
    n, t, vocab = logits.shape
    nll = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="none")  # [N*T]
    return -nll.view(n, t)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: logits [N, L, V] (position t predicts token t+1),
    input_ids [N, L] → [N, L-1] float32."""
    return logprobs_of(logits[:, :-1], input_ids[:, 1:])


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: logits [N, T, V] → [N, T] (float32)."""
    return entropy_of_logprobs(torch.log_softmax(logits.float(), dim=-1))


def entropy_of_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of distributions given as log-probabilities: [..., V] → [...]."""
    return -(logp.exp() * logp).sum(-1)


def completion_mask(
    input_ids: torch.Tensor, prompt_len: int, eos_token_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of positions that score a generated token, decided by position (never by pad id).

    input_ids [N, L]: left-padded prompts of width `prompt_len`, then generated tokens.
    Returns (mask [N, L-1] float, ended [N] bool). mask[i, t] = 1 iff token t+1 was generated and is
    at or before the first EOS of row i's completion; `ended[i]` is False when the row never produced
    an EOS (truncated at max_new_tokens): then all its generated tokens count.
    """
    n, length = input_ids.shape
    completion = input_ids[:, prompt_len:]  # [N, T]
    t = completion.shape[1]
    is_eos = torch.isin(completion, torch.tensor(list(eos_token_ids), device=input_ids.device))  # [N, T]
    ended = is_eos.any(dim=1)  # [N]
    first_eos = torch.where(ended, is_eos.int().argmax(dim=1), torch.full_like(ended, t - 1, dtype=torch.long))
    keep = torch.arange(t, device=input_ids.device)[None, :] <= first_eos[:, None]  # [N, T]
    mask = torch.zeros(n, length - 1, device=input_ids.device)
    mask[:, prompt_len - 1 :] = keep.float()  # logp index prompt_len-1 scores the first generated token
    return mask, ended


def masked_mean_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean over masked entries: x, mask [N, T] → [N]. A row with no tokens gives 0."""
    return (x * mask).sum(1) / (mask.sum(1) + EPS_MASK)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over all masked entries of the batch: x, mask [N, T] → scalar."""
    return (x * mask).sum() / (mask.sum() + EPS_MASK)


def kl_k1(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k1 = log π(y)/π_ref(y) = new − ref per token: unbiased for KL(π ‖ π_ref), can be negative.
    logp_new, logp_ref [N, T] → [N, T]."""
    return logp_new - logp_ref


def kl_k2(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k2 = ½(new − ref)² per token: ≥ 0, biased, low variance. [N, T] → [N, T]."""
    return 0.5 * (logp_new - logp_ref).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) ** 2


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 (the seed's), per token: Δ = clamp(ref − new, ±20), exp(Δ) − Δ − 1 ≥ 0.

    logp_new, logp_ref [N, T] → [N, T]. Its expectation under the policy is KL(π ‖ π_ref); it is 0
    where the two log-probs agree.
    """
    delta = (logp_ref - logp_new).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(delta) - delta - 1


# KL estimators by name: (logp_new [N, T], logp_ref [N, T]) -> per-token estimate [N, T].
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.view(-1, group_size)  # [N/G, G]


def _centred(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r − group mean, has_spread) for grouped rewards [N/G, G] → ([N/G, G], [N/G, 1] bool).

    A group whose rewards are all equal is centred to exactly 0: in floating point its mean can differ
    from its members by one ulp (six rewards of 1.3 in fp32 average to 1.3 − 1.2e-7) while its std is
    exactly 0, and z-scoring that rounding error gives ±0.12 to every member.
    """
    spread = grouped.amax(dim=1, keepdim=True) != grouped.amin(dim=1, keepdim=True)  # [N/G, 1]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return torch.where(spread, centred, torch.zeros_like(centred)), spread


def group_zscore_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """The seed's group-relative advantage (GRPO): A = (r − group mean) / (group population std + 1e-6).

    rewards [N] prompt-major → [N]. A group with equal rewards gets exactly 0; group_size ≤ 1 gives zeros.
    """
    if group_size <= 1:
        return torch.zeros_like(rewards)
    grouped = _groups(rewards, group_size)
    centred, _ = _centred(grouped)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)  # population std
    return (centred / (std + EPS_STD)).view(-1)


def group_mean_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: A = r − group mean (no division by the std, which favours easy and hard prompts).
    rewards [N] → [N]; equal groups get exactly 0."""
    if group_size <= 1:
        return torch.zeros_like(rewards)
    return _centred(_groups(rewards, group_size))[0].view(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = r_i − mean_{j≠i} r_j, the leave-one-out baseline; equals G/(G−1)·(r_i − group mean).
    rewards [N] → [N]; equal groups get exactly 0."""
    if group_size <= 1:
        return torch.zeros_like(rewards)
    grouped = _groups(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [N/G, G]
    _, spread = _centred(grouped)
    return torch.where(spread, grouped - others, torch.zeros_like(grouped)).view(-1)


def batch_zscore_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Batch-level normalisation (REINFORCE++-baseline): subtract the group mean, then divide by the
    population std of those differences over the whole batch. rewards [N] → [N]; equal groups get 0."""
    centred = group_mean_advantages(rewards, group_size)
    return centred / (centred.std(unbiased=False) + EPS_STD)


# Advantage estimators by name: (rewards [N], group_size) -> advantages [N].
ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "group_zscore": group_zscore_advantages,
    "group_mean": group_mean_advantages,
    "rloo": rloo_advantages,
    "batch_zscore": batch_zscore_advantages,
}


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max − buffer tokens, then falling linearly to −factor
    at max tokens. lengths [N] completion tokens → penalty [N] (≤ 0, added to the reward)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -factor * (over / buffer).clamp(max=1.0)


def normalize_advantages(adv: torch.Tensor, group_size: int = 1) -> torch.Tensor:
    """Global z-score over the whole batch: adv [N] → [N]. Groups of `group_size` whose advantages are
    all equal (a group with no reward spread) stay exactly 0; all-equal input gives zeros."""
    out = (adv - adv.mean()) / (adv.std(unbiased=False) + EPS_STD)
    if group_size <= 1:
        return torch.where(adv.amax() != adv.amin(), out, torch.zeros_like(out))
    grouped = _groups(adv, group_size)
    spread = grouped.amax(dim=1, keepdim=True) != grouped.amin(dim=1, keepdim=True)  # [N/G, 1]
    return torch.where(spread, _groups(out, group_size), torch.zeros_like(grouped)).view(-1)


def zero_spread_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they give no policy gradient)."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean().item()


def mismatch_weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, cap: float,
                     in_ratio: bool = False) -> torch.Tensor:
    """Training-inference mismatch correction as detached per-token loss weights: [N, T] → [N, T].

    log_ratio [N, T]: log of the importance weight to correct, per sampled token.
      - in_ratio=False: x = log π_old − log π_engine, a weight the loss does not carry (its own ratio is
        π_θ/π_old, or none for reinforce). token_tis: w = min(e^x, cap) (truncated IS, as TRL/verl).
      - in_ratio=True: x = log π_θ − log π_engine is the loss's own ratio ρ (old_logprobs=engine with
        grpo). token_tis: w = min(ρ, cap)/ρ, so the weighted surrogate is that of ρ truncated at cap.
    sequence_mask (either way): w = 1 for rows whose geometric-mean weight exp(mean_t x) lies in
    [1/cap, cap], else 0 (the whole completion leaves the loss; its tokens stay in the normaliser).
    none: w = 1. Outside the mask the weight is 1 (those tokens are masked by the loss anyway).
    """
    x = log_ratio.detach().float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mode == "none":
        return torch.ones_like(x)
    if mode == "token_tis":
        log_cap = math.log(cap)
        w = torch.exp(x.clamp(max=log_cap) - x) if in_ratio else torch.exp(x.clamp(max=log_cap))
        return torch.where(mask > 0, w, torch.ones_like(w))
    if mode == "sequence_mask":
        keep = masked_mean_rows(x, mask).abs() <= math.log(cap)  # [N]
        return keep.float()[:, None].expand_as(x).clone()
    raise ValueError(f"unknown mismatch correction {mode!r}")
