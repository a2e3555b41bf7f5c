"""Sampling a group of completions per prompt with Hugging Face `generate`, and scoring them.

Each prompt is prefilled once and its KV cache repeated for its G completions (prompt-major order:
completion i belongs to prompt i // G). Log-probs of the sampled tokens under the policy (`logp_old`)
and under the reference (`logp_ref`, LoRA disabled) are recomputed with temperature 1, no top-p,
exactly as the loss computes `logp_new`, so the ratio and the KL are unbiased whatever sampling
temperature was used.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicCache

from llmrl.algorithms.core import completion_mask, entropy_of_logprobs, token_entropy, token_logprobs
from llmrl.models.packed_linear import release_temporary_packs


@dataclass
class Rollout:
    """N = B*G completions of one RL step, prompt-major. L = prompt_len + generated length."""

    input_ids: torch.Tensor  # [N, L] left-padded prompt, then completion (padding after EOS)
    attention_mask: torch.Tensor  # [N, L] 0 on left padding, 1 elsewhere
    completion_mask: torch.Tensor  # [N, L-1] 1 where logp scores a generated token up to its EOS
    logp_old: torch.Tensor  # [N, L-1] behaviour policy log-probs (0 outside the completion)
    logp_ref: torch.Tensor | None  # [N, L-1] reference log-probs, None when kl_coef = 0
    ended: torch.Tensor  # [N] bool: the completion ended with EOS (False: truncated)
    prompt_len: int  # width of the left-padded prompt block
    texts: list[str]  # decoded completions (without EOS)
    prompts_truncated: int  # prompts cut to max_prompt_tokens
    entropy: torch.Tensor | None = None  # [N, L-1] sampling-policy token entropies at temperature 1 (0 outside)

    @property
    def completion_lens(self) -> torch.Tensor:
        """[N] number of scored tokens per completion (EOS included)."""
        return self.completion_mask.sum(1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] positions that skip left padding, as `generate` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [N, L-1] (0 over the prompt), and optionally token entropies [N, L-1].

    Only the logits that score completion tokens are computed (`logits_to_keep`): positions
    prompt_len-1 … L-2, which score tokens prompt_len … L-1.
    """
    n, length = input_ids.shape
    keep = length - prompt_len + 1
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
        logits_to_keep=keep, use_cache=False,
    ).logits  # [N, keep, V]
    prompt_part = torch.zeros(n, prompt_len - 1, device=input_ids.device)
    logp = torch.cat([prompt_part, token_logprobs(logits, input_ids[:, prompt_len - 1 :])], dim=1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = torch.zeros(n, length - 1, device=input_ids.device)
            entropy[:, prompt_len - 1 :] = token_entropy(logits[:, :-1].detach())
    return logp, entropy


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
                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits  # [U, 1, V]: scores token P
    parts = [head[inverse]]
    if length - prompt_len > 1:
        cache.batch_select_indices(inverse.to(input_ids.device))
        parts.append(model(
            input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
            position_ids=position_ids(attention_mask)[:, prompt_len:-1], past_key_values=cache, use_cache=True,
        ).logits)  # [N, T-1, V]: score tokens P+1 … L-1
    logits = torch.cat(parts, dim=1)  # [N, T, V]
    targets = input_ids[:, prompt_len:]  # [N, T]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    logp = torch.cat([torch.zeros(n, prompt_len - 1, device=input_ids.device), -nll.view(n, -1)], dim=1)  # [N, L-1]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = torch.zeros(n, length - 1, device=input_ids.device)
            entropy[:, prompt_len - 1 :] = token_entropy(logits.detach())
    return logp, entropy


@torch.no_grad()
def batched_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, chunk: int,
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


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block with torch's RNG seeded, leaving the global RNG as it was (generate uses it)."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config and tokenizer)."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted(set(ids) | {tokenizer.eos_token_id})


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat messages rendered with the model's template, ready for the reply."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_length(tokenizer, messages: list[dict[str, str]]) -> int:
    return len(render(tokenizer, messages))


def encode_prompts(tokenizer, messages: list[list[dict[str, str]]], max_prompt_tokens: int, device: torch.device):
    """Render chat messages with the model's template, keep the last `max_prompt_tokens` tokens,
    left-pad. Returns (ids [B, P], attention_mask [B, P], number of prompts truncated)."""
    token_lists = [render(tokenizer, m) for m in messages]
    truncated = sum(len(t) > max_prompt_tokens for t in token_lists)
    token_lists = [t[-max_prompt_tokens:] for t in token_lists]
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, t in enumerate(token_lists):
        ids[i, width - len(t) :] = torch.tensor(t, dtype=torch.long)
        mask[i, width - len(t) :] = 1
    return ids.to(device), mask.to(device), truncated


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


@contextlib.contextmanager
def merged_lora(model, enabled: bool = True) -> Iterator[None]:
    """Sample with LoRA merged into the base weights (one matmul per layer instead of three): each
    adapted layer gets a merged copy W + ΔW as its weight while inside, and its own base weight
    tensor back (untouched, bit for bit) after. Plain LoRA layers only: other layers (or other PEFT
    versions' layers) stay unmerged."""
    layers = []
    if enabled:
        for m in model.modules():
            if (hasattr(m, "get_delta_weight") and hasattr(m, "base_layer") and not getattr(m, "merged", True)
                    and not getattr(m, "lora_variant", {}) and not any(getattr(m, "lora_bias", {}).values())):
                layers.append(m)
    swapped = []  # (layer, its base weight tensor)
    try:
        with torch.no_grad():
            for m in layers:
                weight = m.get_base_layer().weight
                merged = weight.data + sum(m.get_delta_weight(a).to(weight.dtype) for a in m.active_adapters if a in m.lora_A)
                swapped.append((m, weight.data))
                weight.data = merged
                m.merged_adapters = [a for a in m.active_adapters if a in m.lora_A]  # PEFT skips the LoRA branch
        yield
    finally:
        for m, original in swapped:
            m.get_base_layer().weight.data = original
            m.merged_adapters = []
        if swapped:
            release_temporary_packs(model)  # packs made of the merged copies, if any


@torch.no_grad()
def generate(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, gen_config: GenerationConfig,
    sampler: KeyedSampler | None = None, with_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`group_size` completions per prompt: [B, P] → (sequences [B*G, P+T] prompt-major, and with
    `with_logits` the raw (temperature-1, unprocessed) logits of each generated position [B*G, T, V]).

    The prompt minus its last token is prefilled once per prompt; the cache is repeated G times and
    `generate` continues from it, which gives the same tokens as generating from the repeated prompts.
    With a `sampler`, tokens are drawn by it (gen_config must be greedy); otherwise by gen_config.
    """
    cache = DynamicCache(config=model.config)
    if prompt_ids.shape[1] > 1:
        model(
            input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
            position_ids=position_ids(prompt_mask)[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        cache.batch_repeat_interleave(group_size)
    gen_config = copy.copy(gen_config)
    gen_config.return_dict_in_generate, gen_config.output_logits = True, with_logits
    out = model.generate(
        input_ids=prompt_ids.repeat_interleave(group_size, 0),
        attention_mask=prompt_mask.repeat_interleave(group_size, 0),
        past_key_values=cache if prompt_ids.shape[1] > 1 else None,
        generation_config=gen_config,
        logits_processor=LogitsProcessorList([sampler]) if sampler is not None else None,
    )
    logits = torch.stack(out.logits, dim=1) if with_logits else None
    return out.sequences, logits


def sampler_logprobs(logits: torch.Tensor, sequences: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(token) and the token entropies at temperature 1 from the sampler's raw logits, laid out
    like `sequence_logprobs`: logits [N, T, V], sequences [N, P+T] → two [N, P+T-1] (0 over the prompt)."""
    n, length = sequences.shape
    logp_out = torch.zeros(n, length - 1, device=sequences.device)
    entropy_out = torch.zeros(n, length - 1, device=sequences.device)
    tokens = sequences[:, prompt_len:]  # [N, T]
    all_logp = torch.log_softmax(logits.float(), dim=-1)  # [N, T, V]
    logp_out[:, prompt_len - 1 :] = all_logp.gather(-1, tokens[..., None]).squeeze(-1)
    entropy_out[:, prompt_len - 1 :] = entropy_of_logprobs(all_logp)
    return logp_out, entropy_out


def generation_config(
    tokenizer, eos: list[int], *, do_sample: bool, temperature: float, top_p: float, top_k: int,
    repetition_penalty: float, min_new_tokens: int, max_new_tokens: int,
) -> GenerationConfig:
    """A complete GenerationConfig, so nothing is inherited from the model's own defaults."""
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else {}
    return GenerationConfig(
        do_sample=do_sample, **sampling, repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )


def decode_completions(tokenizer, completions: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor) -> list[str]:
    """Completion texts without the EOS token: completions [N, T], lengths [N] (EOS included)."""
    return [
        tokenizer.decode(row[: int(n) - int(e)].tolist(), skip_special_tokens=True)
        for row, n, e in zip(completions, lengths, ended)
    ]


def rollout(
    model, tokenizer, messages: list[list[dict[str, str]]], *, group_size: int, gen_config: GenerationConfig,
    max_prompt_tokens: int, seed: int, with_ref: bool, chunk: int, temperature: float, top_p: float, top_k: int,
    first_prompt: int = 0, logp_from_sampler: bool = True, merge_lora: bool = True, shared_prefix: bool = True,
) -> Rollout:
    """Sample G completions for each of B prompts and compute old and reference log-probs.

    Row (b, g) draws its noise from key (seed, first_prompt + b, g): pass a seed derived from the run
    seed and the step, and the global index of the first prompt. gen_config is greedy (the
    KeyedSampler does the sampling). logp_from_sampler: old log-probs from the sampler's own logits
    (else a second forward); merge_lora: sample with LoRA merged into the base weights; shared_prefix:
    forward passes run each prompt once for its group.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no LoRA dropout while sampling or scoring the behaviour policy
    prompt_ids, prompt_mask, truncated = encode_prompts(tokenizer, messages, max_prompt_tokens, device)
    prompt_len = prompt_ids.shape[1]
    keys = [mix(seed, first_prompt + b, g) for b in range(len(messages)) for g in range(group_size)]
    sampler = KeyedSampler(keys, prompt_len, temperature, top_p, top_k)
    with merged_lora(model, merge_lora):
        sequences, logits = generate(model, prompt_ids, prompt_mask, group_size, gen_config, sampler,
                                     with_logits=logp_from_sampler)  # [N, L], [N, T, V]
    attention = torch.ones_like(sequences)
    attention[:, :prompt_len] = prompt_mask.repeat_interleave(group_size, 0)
    mask, ended = completion_mask(sequences, prompt_len, gen_config.eos_token_id)
    group = torch.arange(len(keys), device=device) // group_size if shared_prefix else None
    chunk = -(-chunk // group_size) * group_size if shared_prefix else chunk  # a chunk holds whole groups
    if logits is not None:
        logp_old, entropy = sampler_logprobs(logits, sequences, prompt_len)
        del logits
    else:
        logp_old, entropy = batched_logprobs(model, sequences, attention, prompt_len, chunk, group, with_entropy=True)
    logp_old, entropy = logp_old * mask, entropy * mask
    logp_ref = None
    if with_ref:
        with model.disable_adapter():
            logp_ref = batched_logprobs(model, sequences, attention, prompt_len, chunk, group)[0] * mask
    model.train(was_training)
    lengths = mask.sum(1)
    texts = decode_completions(tokenizer, sequences[:, prompt_len:], lengths, ended)
    return Rollout(
        input_ids=sequences, attention_mask=attention, completion_mask=mask, logp_old=logp_old, logp_ref=logp_ref,
        ended=ended, prompt_len=prompt_len, texts=texts, prompts_truncated=truncated, entropy=entropy,
    )


def select_rows(r: Rollout, rows: list[int]) -> Rollout:
    """The rollout restricted to `rows` (in that order)."""
    idx = torch.tensor(rows, dtype=torch.long, device=r.input_ids.device)
    return Rollout(
        input_ids=r.input_ids[idx], attention_mask=r.attention_mask[idx], completion_mask=r.completion_mask[idx],
        logp_old=r.logp_old[idx], logp_ref=None if r.logp_ref is None else r.logp_ref[idx], ended=r.ended[idx],
        prompt_len=r.prompt_len, texts=[r.texts[i] for i in rows], prompts_truncated=r.prompts_truncated,
        entropy=None if r.entropy is None else r.entropy[idx],
    )


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rows of several rollouts in one: prompts left-padded to the widest prompt block, completions
    right-padded to the longest (padding is masked out: attention 0 on the left, completion mask 0)."""
    if len(parts) == 1:
        return parts[0]
    p = max(r.prompt_len for r in parts)
    t = max(r.input_ids.shape[1] - r.prompt_len for r in parts)

    def widen(x: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (left, right), value=value)

    def pads(r: Rollout) -> tuple[int, int]:
        return p - r.prompt_len, t - (r.input_ids.shape[1] - r.prompt_len)

    return Rollout(
        input_ids=torch.cat([widen(r.input_ids, *pads(r), pad_id) for r in parts]),
        attention_mask=torch.cat([widen(widen(r.attention_mask, pads(r)[0], 0, 0), 0, pads(r)[1], 1) for r in parts]),
        completion_mask=torch.cat([widen(r.completion_mask, *pads(r), 0) for r in parts]),
        logp_old=torch.cat([widen(r.logp_old, *pads(r), 0) for r in parts]),
        logp_ref=None if parts[0].logp_ref is None else torch.cat([widen(r.logp_ref, *pads(r), 0) for r in parts]),
        ended=torch.cat([r.ended for r in parts]), prompt_len=p, texts=[x for r in parts for x in r.texts],
        prompts_truncated=sum(r.prompts_truncated for r in parts),
        entropy=None if parts[0].entropy is None else torch.cat([widen(r.entropy, *pads(r), 0) for r in parts]),
    )
