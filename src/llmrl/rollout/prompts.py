"""Chat prompts in and completion texts out: the model's template, left padding, EOS ids, decoding."""

from __future__ import annotations

import torch


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


def decode_completions(tokenizer, completions: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor) -> list[str]:
    """Completion texts without the EOS token: completions [N, T], lengths [N] (EOS included)."""
    return [
        tokenizer.decode(row[: int(n) - int(e)].tolist(), skip_special_tokens=True)
        for row, n, e in zip(completions, lengths, ended)
    ]


