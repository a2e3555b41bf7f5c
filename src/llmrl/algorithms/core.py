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


# Training-inference mismatch correction (rollout_engine=vllm). Each mode is a function
# (x [N, T], mask [N, T], cap, in_ratio) -> detached per-token loss weights [N, T], where x is the per-token log of
# the importance weight to correct, already detached and clamped to ±20:
#   in_ratio=False: x = log π_old − log π_engine, a weight the loss does not carry (its own ratio is π_θ/π_old, or
#     none for reinforce).
#   in_ratio=True: x = log π_θ − log π_engine is the loss's own ratio ρ (old_logprobs=engine with grpo); the weight
#     is then the peer's weight divided by the ratio the loss already carries (ρ_t per token, r per row).
# r = exp(Σ_t x_t) (clamped to ±20 in log space) is the sequence's importance ratio: the product of its token ratios.
# Weights outside the mask do not matter (the loss masks those tokens).


def _rows(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-row values w [N] broadcast to every token: [N, T]."""
    return w[:, None].expand_as(x).clone()


def _log_sequence_ratio(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r = Σ_t x_t over each row's completion tokens, clamped to ±20: [N, T] → [N]."""
    return (x * mask).sum(1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def geo_mean_keep(x: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Rows whose geometric-mean token ratio exp(mean_t x_t) lies in [1/cap, cap]: [N, T] → [N] bool."""
    return masked_mean_rows(x, mask).abs() <= math.log(cap)


def mismatch_none(x: torch.Tensor, mask: torch.Tensor, cap: float, in_ratio: bool) -> torch.Tensor:
    """No correction: w = 1."""
    return torch.ones_like(x)


def mismatch_token_tis(x: torch.Tensor, mask: torch.Tensor, cap: float, in_ratio: bool) -> torch.Tensor:
    """Truncated IS per token (TRL's token_truncate without a lower bound; verl's rollout_is=token):
    w_t = min(e^x_t, cap); in_ratio: min(ρ_t, cap)/ρ_t, so the weighted surrogate is that of ρ truncated at cap."""
    log_cap = math.log(cap)
    w = torch.exp(x.clamp(max=log_cap) - x) if in_ratio else torch.exp(x.clamp(max=log_cap))
    return torch.where(mask > 0, w, torch.ones_like(w))


def mismatch_sequence_truncate(x: torch.Tensor, mask: torch.Tensor, cap: float, in_ratio: bool) -> torch.Tensor:
    """TRL's sequence_truncate (no lower bound), verl's rollout_is=sequence: every token of a row weighs
    min(r, cap); in_ratio: min(r, cap)/r."""
    log_r = _log_sequence_ratio(x, mask)  # [N]
    log_w = log_r.clamp(max=math.log(cap)) - (log_r if in_ratio else 0.0)
    return _rows(torch.exp(log_w), x)


def mismatch_sequence_mask(x: torch.Tensor, mask: torch.Tensor, cap: float, in_ratio: bool) -> torch.Tensor:
    """TRL's sequence_mask (its default: no lower bound): a row weighs r while r ≤ cap, else 0; its tokens stay
    in the loss normaliser. in_ratio: 1 while r ≤ cap, else 0."""
    log_r = _log_sequence_ratio(x, mask)  # [N]
    kept = torch.ones_like(log_r) if in_ratio else torch.exp(log_r)
    return _rows(torch.where(log_r <= math.log(cap), kept, torch.zeros_like(log_r)), x)


def mismatch_geo_mean_mask(x: torch.Tensor, mask: torch.Tensor, cap: float, in_ratio: bool) -> torch.Tensor:
    """llmrl's own: a row weighs 1 while exp(mean_t x_t) ∈ [1/cap, cap], else 0 (either way); its tokens stay in
    the loss normaliser."""
    return _rows(geo_mean_keep(x, mask, cap).float(), x)


def mismatch_seq_mean_k1(x: torch.Tensor, mask: torch.Tensor, cap: float, in_ratio: bool) -> torch.Tensor:
    """verl's rollout_rs=seq_mean_k1 with threshold cap (bounds 1/cap, cap): geo_mean_mask's rows, weight 1 on the
    kept ones. The rejected rows also leave the loss mask (`mismatch_loss_mask`), so the normaliser too."""
    return mismatch_geo_mean_mask(x, mask, cap, in_ratio)


# Mismatch corrections by name (config.MISMATCH_CORRECTIONS lists the same names).
MISMATCH_WEIGHTS: dict[str, Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]] = {
    "none": mismatch_none,
    "token_tis": mismatch_token_tis,
    "sequence_truncate": mismatch_sequence_truncate,
    "sequence_mask": mismatch_sequence_mask,
    "geo_mean_mask": mismatch_geo_mean_mask,
    "seq_mean_k1": mismatch_seq_mean_k1,
}
# Modes whose rejected rows leave the loss mask, not only the loss's numerator.
MISMATCH_REMOVES_ROWS = ("seq_mean_k1",)


def mismatch_weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, cap: float,
                     in_ratio: bool = False) -> torch.Tensor:
    """Training-inference mismatch correction as detached per-token loss weights: log_ratio, mask [N, T] →
    [N, T] by MISMATCH_WEIGHTS[mode] (see the notes above it: x, r, in_ratio)."""
    if mode not in MISMATCH_WEIGHTS:
        raise ValueError(f"unknown mismatch correction {mode!r} (known: {', '.join(MISMATCH_WEIGHTS)})")
    x = log_ratio.detach().float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return MISMATCH_WEIGHTS[mode](x, mask, cap, in_ratio)


def mismatch_loss_mask(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """The completion mask the loss averages over: mask [N, T], except that the MISMATCH_REMOVES_ROWS modes
    (verl's rejection) zero the rows they reject, so these leave the token-mean normaliser and the KL term."""
    if mode not in MISMATCH_REMOVES_ROWS:
        return mask
    x = log_ratio.detach().float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return mask * geo_mean_keep(x, mask, cap).to(mask.dtype)[:, None]
