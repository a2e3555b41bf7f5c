"""The `hf` rollout engine: Hugging Face `generate` on the policy itself.

Each prompt is prefilled once and its KV cache repeated for its G completions (prompt-major order:
completion i belongs to prompt i // G); tokens are drawn by the KeyedSampler (generate itself is
greedy over its choice); LoRA is merged into the base weights while sampling where they are
multiplied in fp32 (`merge_lora`; bf16 products sample unmerged, models/lora.py:merge_is_exact); the
sampler's raw logits give the old log-probs and entropies without a second forward (`sampler_logp`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicCache, DynamicLayer

from llmrl.algorithms.core import completion_mask
from llmrl.models.lora import merged_lora
from llmrl.models.scoring import CACHE, inference_mode, position_ids, sampler_logprobs
from llmrl.rollout.base import Reply, Sampling
from llmrl.rollout.keyed import KeyedSampler
from llmrl.rollout.prompts import eos_ids


def greedy_config(tokenizer, eos: list[int], *, repetition_penalty: float, min_new_tokens: int,
                  max_new_tokens: int) -> GenerationConfig:
    """A complete greedy GenerationConfig, so nothing is inherited from the model's own defaults
    (sampling is the KeyedSampler's job)."""
    return GenerationConfig(
        do_sample=False, repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens,
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )


class RepetitionPenalty(LogitsProcessor):
    """transformers' repetition penalty (the score of each id the row holds: × penalty where < 0,
    else ÷ penalty) over the row's own tokens only: its input columns where input_mask [N, W] is 1 and
    its generated tokens up to and including its first EOS. transformers' own skips at most a row's
    leading padding: it counts the gaps resume_rows leaves between a kept prefix and the new tokens and
    the padding after a finished row's EOS, which depend on the other rows of the batch."""

    def __init__(self, penalty: float, input_mask: torch.Tensor, eos: list[int]):
        self.penalty, self.input_mask, self.eos = penalty, input_mask.bool(), torch.tensor(eos, dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        generated = input_ids[:, self.input_mask.shape[1]:]
        stop = torch.isin(generated, self.eos.to(generated.device)).long()
        real = torch.cat([self.input_mask.to(input_ids.device), stop.cumsum(1) - stop == 0], 1)
        ids = input_ids.clamp(max=vocab).masked_fill(~real, vocab)  # vocab: a spare column, dropped below
        scores = torch.nn.functional.pad(scores, (0, 1))
        score = scores.gather(1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return scores.scatter(1, ids, score)[:, :vocab]


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into spare room instead of concatenating: its keys and values are
    views [B, H, length, D] of buffers [B, H, capacity, D], so a decode step writes its one new
    position instead of copying the whole cache (at 512 tokens, 16 rows of SmolLM2-135M: ~400 MB a
    step). Capacity starts at `reserve` (or what the first update needs) and doubles when full; a
    cache another method replaced (batch_repeat_interleave, batch_select_indices, crop) is copied
    into a fresh buffer at the next update."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, end = self.get_seq_length(), self.get_seq_length() + key_states.shape[-2]
        buffers = self._buffers
        if (buffers is None or self.keys._base is not buffers[0] or self.values._base is not buffers[1]
                or end > buffers[0].shape[-2]):
            capacity = max(self.reserve, end) if buffers is None else max(self.reserve, 2 * end)
            buffers = tuple(s.new_empty(*s.shape[:-2], capacity, s.shape[-1]) for s in (key_states, value_states))
            if length:
                buffers[0][..., :length, :].copy_(self.keys)
                buffers[1][..., :length, :].copy_(self.values)
            self._buffers = buffers
        buffers[0][..., length:end, :].copy_(key_states)
        buffers[1][..., length:end, :].copy_(value_states)
        self.keys, self.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
        return self.keys, self.values


def growing_cache(config, reserve: int) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are GrowingLayers with room for
    `reserve` positions (other layer kinds, e.g. sliding windows, stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.no_grad()
def generate(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, gen_config: GenerationConfig,
    sampler: KeyedSampler | None = None, with_logits: bool = False, cache: DynamicCache | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None, DynamicCache | None]:
    """`group_size` completions per prompt: [B, P] → (sequences [B*G, P+T] prompt-major, with
    `with_logits` the raw (temperature-1, unprocessed) logits of each generated position: T × [B*G, V],
    and the cache: [B*G, H, P+T-1, D] per layer, the last token not run).

    The prompt minus its last token is prefilled once per prompt; the cache is repeated G times and
    `generate` continues from it, which gives the same tokens as generating from the repeated prompts.
    A `cache` given (group_size 1) already holds the first columns of the prompt; generate runs the rest.
    With a `sampler`, tokens are drawn by it; otherwise greedily. A repetition penalty other than 1
    counts each row's own tokens only (RepetitionPenalty, in place of transformers' own).
    """
    if cache is None:
        cache = growing_cache(model.config, reserve=prompt_ids.shape[1] + gen_config.max_new_tokens)
        if prompt_ids.shape[1] > 1:
            model(
                input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
                position_ids=position_ids(prompt_mask)[:, :-1], **{CACHE: cache}, use_cache=True, logits_to_keep=1,
            )
            cache.batch_repeat_interleave(group_size)
    else:
        assert group_size == 1, "a given cache holds one row per prompt"
    gen_config = copy.copy(gen_config)
    gen_config.return_dict_in_generate, gen_config.output_logits = True, with_logits
    input_mask = prompt_mask.repeat_interleave(group_size, 0)
    processors = [] if sampler is None else [sampler]
    if gen_config.repetition_penalty not in (None, 1.0):  # before the sampler, as transformers' own would be
        eos = gen_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        processors.insert(0, RepetitionPenalty(gen_config.repetition_penalty, input_mask, eos))
        gen_config.repetition_penalty = 1.0
    out = model.generate(
        input_ids=prompt_ids.repeat_interleave(group_size, 0),
        attention_mask=input_mask,
        **{CACHE: cache if cache.get_seq_length() else None},
        generation_config=gen_config,
        logits_processor=LogitsProcessorList(processors) if processors else None,
    )
    return out.sequences, (out.logits if with_logits else None), getattr(out, CACHE, None)


@dataclass
class Kept:
    """One row's KV cache after a reply: the token ids it covers and per layer (keys, values) [H, len, D]."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def keep_rows(cache: DynamicCache, sequences: torch.Tensor, input_mask: torch.Tensor, lengths: list[int]) -> list[Kept]:
    """Each row's cache without its padding: the input columns where input_mask [N, W] is 1, then the
    first `lengths[i]` generated columns (those the cache holds: all but the last token generated)."""
    width, held = input_mask.shape[1], cache.get_seq_length()
    kept = []
    for i, n in enumerate(lengths):
        cols = torch.cat([input_mask[i].nonzero().squeeze(1),
                          torch.arange(width, width + max(0, min(n, held - width)), device=input_mask.device)])
        kept.append(Kept(sequences[i, cols].tolist(),
                         [(layer.keys[i].index_select(1, cols), layer.values[i].index_select(1, cols))
                          for layer in cache.layers]))
    return kept


def resume_rows(model, contexts: list[list[int]], kept: list[Kept], pad_id: int, reserve: int, device
                ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
    """A batch that continues from kept caches: each context's longest kept prefix (at most all but
    its last token) goes into the cache, the rest into the input. Row layout [N, C + S]: the cached
    prefix left-padded to C columns, then the new tokens left-padded to S; padding is masked out, so
    positions (mask cumsum) and attention are those of the unpadded context."""
    def best(c: list[int]) -> Kept | None:
        hits = [k for k in kept if len(k.ids) < len(c) and c[: len(k.ids)] == k.ids]
        return max(hits, key=lambda k: len(k.ids), default=None)

    found = [best(c) for c in contexts]
    cached = [0 if k is None else len(k.ids) for k in found]
    c_width, s_width = max(cached), max(len(c) - n for c, n in zip(contexts, cached))
    ids = torch.full((len(contexts), c_width + s_width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (c, n) in enumerate(zip(contexts, cached)):
        ids[i, c_width - n: c_width], mask[i, c_width - n: c_width] = torch.tensor(c[:n], dtype=torch.long), 1
        ids[i, c_width + s_width - (len(c) - n):], mask[i, c_width + s_width - (len(c) - n):] = torch.tensor(c[n:], dtype=torch.long), 1
    cache = growing_cache(model.config, reserve=c_width + s_width + reserve)
    if c_width:
        some = next(k for k in found if k is not None)
        for layer, (k0, v0) in enumerate(some.kv):
            keys = k0.new_zeros(len(contexts), k0.shape[0], c_width, k0.shape[2])
            values = v0.new_zeros(len(contexts), v0.shape[0], c_width, v0.shape[2])
            for i, (k, n) in enumerate(zip(found, cached)):
                if k is not None:
                    keys[i, :, c_width - n:], values[i, :, c_width - n:] = k.kv[layer]
            cache.layers[layer].update(keys, values)
    return ids.to(device), mask.to(device), cache


class HFEngine:
    """Rollouts and eval with HF generate on the live policy (see the module docstring)."""

    def __init__(self, tokenizer, sampling: Sampling, *, merge_lora: bool, sampler_logp: bool):
        self.tokenizer, self.sampling = tokenizer, sampling
        self.merge_lora, self.sampler_logp = merge_lora, sampler_logp
        self.model, self.version = None, -1
        self._kept: list[Kept] | None = None  # inside episodes(): the rows of the last continue_ids call

    @contextmanager
    def episodes(self):
        """Within one rollout's episodes (one policy): each continue_ids keeps its rows' KV caches and the
        next turn runs only the new tokens (the reply's last token and the environment's delta) instead
        of prefilling the whole context again. Models with other than full-attention layers (sliding
        windows) re-prefill."""
        self._kept = [] if all(type(x) is GrowingLayer for x in growing_cache(self.model.config, 0).layers) else None
        try:
            yield
        finally:
            self._kept = None

    def load(self, model, version: int) -> None:
        """HF generates with the policy object itself, so it always samples the current weights."""
        self.model, self.version = model, version

    def release(self) -> None:
        """Nothing to free: HF samples with the policy's own weights."""

    def close(self) -> None:
        """Nothing to stop."""

    def _config(self, **kw) -> GenerationConfig:
        return greedy_config(self.tokenizer, eos_ids(self.model, self.tokenizer), **kw)

    def continue_ids(self, contexts: list[list[int]], keys: list[int], s: Sampling, max_new_tokens: int,
                     greedy: bool = False, group_size: int = 1, logprobs: bool = True) -> list[Reply]:
        """Token-in/token-out (each turn of every rollout and eval): one reply to each context of exact
        token ids, drawn with `s` and noise keyed by `keys` (greedy: argmax, keys unused). The sampler's raw logits give each
        reply token's log-prob where `sampler_logp` holds (the trainer's full forward matches them).
        group_size: consecutive runs of that many equal contexts (an episode's first turn) are
        prefilled once each, as `generate` does for a group."""
        model = self.model
        device = next(model.parameters()).device
        config = self._config(repetition_penalty=s.repetition_penalty, min_new_tokens=0 if greedy else s.min_new_tokens,
                              max_new_tokens=max_new_tokens)
        cache = None
        if self._kept and group_size == 1:  # later turns: continue each episode's cache
            ids, mask, cache = resume_rows(model, contexts, self._kept, self.tokenizer.pad_token_id, max_new_tokens, device)
        else:
            width = max(len(c) for c in contexts)
            unique = contexts[::group_size]
            assert all(contexts[i] == unique[i // group_size] for i in range(len(contexts))), "contexts are not in groups"
            ids = torch.full((len(unique), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, c in enumerate(unique):
                ids[i, width - len(c):], mask[i, width - len(c):] = torch.tensor(c, dtype=torch.long), 1
            ids, mask = ids.to(device), mask.to(device)
        width = ids.shape[1]
        sampler = None if greedy else KeyedSampler(keys, width, s.temperature, s.top_p, s.top_k)
        with inference_mode(model), merged_lora(model, self.merge_lora):
            sequences, logits, cache = generate(model, ids, mask, group_size, config, sampler,
                                                with_logits=self.sampler_logp and logprobs and not greedy, cache=cache)
        cmask, ended = completion_mask(sequences, width, config.eos_token_id)
        logp, entropy = sampler_logprobs(logits, sequences, width) if logits is not None else (None, None)
        del logits
        lengths = cmask.sum(1).long().tolist()
        if self._kept is not None:
            self._kept = keep_rows(cache, sequences, mask.repeat_interleave(group_size, 0), lengths)
        del cache

        def of_reply(x: torch.Tensor | None, i: int, n: int) -> list[float] | None:
            return None if x is None else x[i, width - 1: width - 1 + n].tolist()

        return [Reply(sequences[i, width: width + n].tolist(), bool(ended[i]), of_reply(logp, i, n), of_reply(entropy, i, n))
                for i, n in enumerate(lengths)]
