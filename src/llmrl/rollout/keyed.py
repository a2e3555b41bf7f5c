"""Keyed sampling noise: each completion's randomness is a hash of (seed, step, prompt, place in its
group, position, token id), so a completion does not depend on which other rows share its batch, and
resume, reruns, prefix sharing, dynamic-sampling rounds and data-parallel ranks all draw the same tokens."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def mix(*parts: int) -> int:
    """A 63-bit integer hash of integers (splitmix64 rounds): seeds for keyed noise."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h >> 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(h: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (h >> bits) & ((1 << (64 - bits)) - 1)


def keyed_uniform(row_seeds: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) noise, float64, for token ids tokens [N, K] of rows with 63-bit seeds [N]:
    a splitmix64 hash of (row seed, token id), so the noise of a token does not depend on which
    other tokens are drawn, or in which order."""
    h = row_seeds[:, None] ^ (tokens * _signed(0x9E3779B97F4A7C15))
    h = (h ^ _shift_right(h, 30)) * _signed(0xBF58476D1CE4E5B9)
    h = (h ^ _shift_right(h, 27)) * _signed(0x94D049BB133111EB)
    h = h ^ _shift_right(h, 31)
    return (_shift_right(h, 11).double() + 0.5) / float(1 << 53)


class KeyedSampler(LogitsProcessor):
    """Sampling as a logits processor, with noise keyed by (row key, position, token) instead of a shared RNG.

    temperature → top-k → top-p, then the Gumbel-max trick: argmax(log p + Gumbel) is a sample from p.
    The scores it returns keep only the sampled token, so greedy `generate` picks it. Because each
    row's noise depends only on its key, a completion does not depend on which other rows share the
    batch: the same tokens come out with or without prefix sharing, dynamic-sampling rounds, or
    data-parallel ranks. row_keys [N] ints; prompt_width: columns of input_ids before generation.
    Only the `candidates` (else 16·`candidates`) most likely tokens are sorted and drawn noise for,
    when they hold the whole nucleus (top_p) of every row; otherwise the whole vocabulary is (same
    choice either way: the noise of a token is a hash of its id).
    """

    def __init__(self, row_keys: list[int], prompt_width: int, temperature: float, top_p: float, top_k: int,
                 candidates: int = 256):
        self.row_keys, self.prompt_width = row_keys, prompt_width
        self.temperature, self.top_p, self.top_k, self.candidates = temperature, top_p, top_k, candidates
        self.full_vocab_draws = 0  # steps that drew over the whole vocabulary

    def choose(self, logits: torch.Tensor, seeds: torch.Tensor, k: int, partial: bool = False) -> torch.Tensor | None:
        """The sampled token ids [N] among the top k of logits [N, V] (already divided by the
        temperature). partial: the top k are only candidates for the nucleus (top_k is 0), and None
        comes back when some row's nucleus extends past them."""
        vocab = logits.shape[-1]
        if k >= vocab and self.top_p >= 1.0:  # plain sampling: every token, no order needed
            values, ids = logits, torch.arange(vocab, device=logits.device).expand_as(logits)
        else:
            values, ids = torch.topk(logits, k, dim=-1)  # [N, k] sorted, most likely first
        if self.top_p < 1.0:
            # probabilities within the top-k-filtered distribution (the whole vocabulary when top_k is 0)
            norm = torch.logsumexp(values if self.top_k > 0 else logits, dim=-1, keepdim=True)
            probs = (values - norm).exp()
            before = probs.cumsum(-1) - probs  # mass of the more likely tokens
            if partial and bool((before[:, -1] + probs[:, -1] < self.top_p).any()):
                return None
            values = values.masked_fill(before >= self.top_p, float("-inf"))  # after the nucleus is full
        gumbel = -torch.log(-torch.log(keyed_uniform(seeds, ids))).to(values.dtype)
        return ids.gather(1, (values + gumbel).argmax(-1, keepdim=True)).squeeze(1)  # [N]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature  # [N, V]
        vocab = logits.shape[-1]
        t = input_ids.shape[1] - self.prompt_width
        seeds = torch.tensor([mix(key, t) for key in self.row_keys], dtype=torch.long, device=logits.device)
        limit = min(self.top_k, vocab) if self.top_k > 0 else vocab
        choice = None
        if self.top_k <= 0 and self.top_p < 1.0:  # a nucleus: try the likeliest tokens first
            for k in (self.candidates, 16 * self.candidates):
                if k < vocab and choice is None:
                    choice = self.choose(logits, seeds, k, partial=True)
        if choice is None:
            self.full_vocab_draws += limit == vocab
            choice = self.choose(logits, seeds, limit)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(1, choice[:, None], 0.0)


