"""Scoring: the log-prob forwards of a policy over sampled sequences, used by rollout (old and
reference log-probs) and by the update (new log-probs) alike.

Every forward is laid out the same way: sequences [N, L] are left-padded prompts of width P followed
by completions, and per-token outputs are [N, L-1] where entry t scores token t+1 (0 over the prompt).
All log-probs use the raw logits (temperature 1, no top-p), so old, new and reference log-probs are
computed the same way whatever sampling temperature produced the tokens.

    sequence_logprobs       one forward over whole sequences (with grad when the caller has it)
    shared_prefix_logprobs  each distinct prompt run once, its KV cache indexed out to its rows
    chunked_logprobs        no grad, a chunk of rows at a time, either of the above
    sampler_logprobs        from the logits the sampler already computed (no forward at all)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from llmrl.algorithms.core import entropy_of_logprobs, logprobs_of, token_entropy


def _cache_keyword() -> str:
    """The keyword a model call takes its KV cache by: `cache` from transformers 5.2x on (where
    `past_key_values` is deprecated), `past_key_values` before."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


CACHE = _cache_keyword()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] positions that skip left padding, as `generate` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def per_token(values: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Completion-token values [N, T] laid out as [N, P+T-1]: 0 at the P-1 positions before the
    first generated token."""
    return torch.cat([values.new_zeros(values.shape[0], prompt_len - 1), values], dim=1)


def _scores(parts: Sequence[torch.Tensor], targets: torch.Tensor, prompt_len: int,
            with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits of consecutive completion positions, in parts [N, T_i, V] (ΣT_i = T), scoring targets
    [N, T] → (logp [N, P+T-1], entropies [N, P+T-1] or None). Each part is scored where it lies: the
    [N, T, V] logits are never concatenated (a copy of the largest tensor of the step, and another in backward)."""
    logp, entropy, start = [], [], 0
    for logits in parts:
        end = start + logits.shape[1]
        if with_entropy and not logits.requires_grad:  # no grad: one log-softmax serves both (the same bits)
            all_logp = torch.log_softmax(logits.float(), dim=-1)  # [N, T_i, V]
            logp.append(all_logp.gather(-1, targets[:, start:end, None]).squeeze(-1))
            entropy.append(entropy_of_logprobs(all_logp))
            del all_logp
        else:
            logp.append(logprobs_of(logits, targets[:, start:end]))
            if with_entropy:
                with torch.no_grad():
                    entropy.append(token_entropy(logits.detach()))
        start = end
    logp = per_token(torch.cat(logp, dim=1), prompt_len)
    return logp, per_token(torch.cat(entropy, dim=1), prompt_len) if with_entropy else None


def sequence_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [N, L-1] (0 over the prompt), and optionally token entropies [N, L-1].

    Only the logits that score completion tokens are computed (`logits_to_keep` as indices):
    positions prompt_len-1 … L-2, which score tokens prompt_len … L-1; contiguous, so scoring them
    copies nothing.
    """
    length = input_ids.shape[1]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
        logits_to_keep=torch.arange(prompt_len - 1, length - 1, device=input_ids.device), use_cache=False,
    ).logits  # [N, T, V]
    return _scores([logits], input_ids[:, prompt_len:], prompt_len, with_entropy)


def select_cache_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """`cache.batch_select_indices(rows)` through index_select, whose backward adds rows back
    (index_add) where an index's backward is an accumulating index_put: per layer's keys of the
    cpu-bench update, 0.2 vs 1.2 ms."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        else:
            layer.batch_select_indices(rows)


def shared_prefix_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, group: torch.Tensor,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` with each prompt run once for all the rows that share it (rows with equal
    `group` [N] have identical left-padded prompts): the prompts' KV cache, with gradient, is indexed
    out to the rows, which then run only their completion tokens. U·P + N·T tokens instead of N·(P + T).
    """
    n, length = input_ids.shape
    uniq, inverse = torch.unique(group, return_inverse=True)  # inverse [N]: row → its prompt
    first = torch.empty(len(uniq), dtype=torch.long, device=input_ids.device)
    first.scatter_(0, inverse.flip(0), torch.arange(n - 1, -1, -1, device=input_ids.device))  # a row of each prompt
    prompt_mask = attention_mask[first, :prompt_len]
    cache = DynamicCache(config=model.config)
    head = model(input_ids=input_ids[first, :prompt_len], attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                 **{CACHE: cache}, use_cache=True, logits_to_keep=1).logits  # [U, 1, V]: scores token P
    parts = [head.index_select(0, inverse)]
    if length - prompt_len > 1:
        select_cache_rows(cache, inverse.to(input_ids.device))
        parts.append(model(
            input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
            position_ids=position_ids(attention_mask)[:, prompt_len:-1], **{CACHE: cache}, use_cache=True,
        ).logits)  # [N, T-1, V]: score tokens P+1 … L-1
    return _scores(parts, input_ids[:, prompt_len:], prompt_len, with_entropy)


@torch.no_grad()
def chunked_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, chunk: int,
                     group: torch.Tensor | None = None, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` without grad, `chunk` rows at a time: [N, L] → ([N, L-1], entropies [N, L-1]
    or None). With `group` [N], rows sharing a prompt run it once (`shared_prefix_logprobs`)."""
    parts = []
    for i in range(0, input_ids.shape[0], chunk):
        rows = slice(i, i + chunk)
        if group is None:
            parts.append(sequence_logprobs(model, input_ids[rows], attention_mask[rows], prompt_len, with_entropy))
        else:
            parts.append(shared_prefix_logprobs(model, input_ids[rows], attention_mask[rows], prompt_len, group[rows], with_entropy))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if with_entropy else None


def sampler_logprobs(logits: Sequence[torch.Tensor], sequences: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(token) and the token entropies at temperature 1 from the sampler's raw logits, laid out
    like `sequence_logprobs`: logits T × [N, V] (one per generated position, as `generate` returns
    them), sequences [N, P+T] → two [N, P+T-1] (0 over the prompt).

    One position at a time, so the only [N, T, V] tensor is the one `generate` already holds (no
    stacked copy, no full-size log-softmax: at 512 tokens × 16 rows × 49k vocab each would be 1.6 GB)."""
    logp = torch.empty(sequences.shape[0], len(logits), device=sequences.device)
    entropy = torch.empty_like(logp)
    for t, step_logits in enumerate(logits):
        all_logp = torch.log_softmax(step_logits.float(), dim=-1)  # [N, V]: one softmax serves both
        logp[:, t] = all_logp.gather(-1, sequences[:, prompt_len + t, None]).squeeze(-1)
        entropy[:, t] = entropy_of_logprobs(all_logp)
    return per_token(logp, prompt_len), per_token(entropy, prompt_len)


@contextlib.contextmanager
def inference_mode(model) -> Iterator[None]:
    """model.eval() inside the block (no dropout), its previous train/eval mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
