"""Chat prompts in and completion texts out: the model's template, left padding, EOS ids, decoding."""

from __future__ import annotations

import re

import torch


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config and tokenizer)."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted(set(ids) | {tokenizer.eos_token_id})


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of plain text (a message's content): text that spells a special token (`<|im_end|>`)
    stays text, never the control token."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


_SPECIAL: dict[int, tuple[object, re.Pattern | None]] = {}  # id(tokenizer) -> (tokenizer, its special tokens' pattern)


def spells_special(tokenizer, text: str) -> bool:
    """Whether `text` contains the spelling of one of the tokenizer's special tokens."""
    cached = _SPECIAL.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        names = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
                       | set(tokenizer.all_special_tokens), key=len, reverse=True)
        cached = _SPECIAL[id(tokenizer)] = (tokenizer, re.compile("|".join(map(re.escape, names))) if names else None)
    return cached[1] is not None and cached[1].search(text) is not None


def template_ids(tokenizer, render_text, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `render_text(messages)` (the chat template's text of messages, or a part of it) in which
    message contents are plain text: the template's own markup gives its special tokens, a content that spells
    one does not. Messages without such a spelling are tokenised with the template's text as one string (so
    ordinary prompts get exactly the ids they always had); otherwise each such content is rendered as a
    placeholder and tokenised on its own with `text_ids`."""
    hostile = [k for k, m in enumerate(messages) if isinstance(m.get("content"), str) and spells_special(tokenizer, m["content"])]
    if not hostile:
        return tokenizer(render_text(messages), add_special_tokens=False)["input_ids"]
    marks = {f"{PLACEHOLDER}{k}x": messages[k]["content"] for k in hostile}
    shown = [{**m, "content": f"{PLACEHOLDER}{k}x"} if k in hostile else m for k, m in enumerate(messages)]
    parts = re.split(f"({'|'.join(map(re.escape, marks))})", render_text(shown))
    if sorted(p for p in parts if p in marks) != sorted(marks):  # the template rewrote a content: drop the spellings
        safe = [{**m, "content": defang(tokenizer, m["content"])} if k in hostile else m for k, m in enumerate(messages)]
        return tokenizer(render_text(safe), add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for part in parts:
        ids += text_ids(tokenizer, marks[part]) if part in marks else tokenizer(part, add_special_tokens=False)["input_ids"]
    return ids


PLACEHOLDER = "LLMRL-TEXT-5c1e-"  # + k + "x": message k's content, while the template is rendered


def defang(tokenizer, text: str) -> str:
    """`text` with every special token's spelling broken by a space after its first character (the fallback
    for a template that changes the content it renders)."""
    spells_special(tokenizer, text)
    pattern = _SPECIAL[id(tokenizer)][1]
    return text if pattern is None else pattern.sub(lambda m: m[0][0] + " " + m[0][1:], text)


def render(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of chat messages rendered with the model's template, ready for the reply (contents are
    plain text: template_ids); `tools`: the JSON schemas the template shows (None: no tools)."""
    return template_ids(tokenizer, lambda ms: tokenizer.apply_chat_template(ms, tools=tools, tokenize=False,
                                                                            add_generation_prompt=True), messages)


def prompt_length(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> int:
    return len(render(tokenizer, messages, tools))


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
