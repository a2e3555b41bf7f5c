"""Evaluation: greedy completions of the task's fixed eval prompts, graded by the task's grader."""

from __future__ import annotations

from typing import Any

import torch

from llmrl.rollout.sampler import decode_completions, encode_prompts, eos_ids, generate, generation_config, merged_lora
from llmrl.algorithms.core import completion_mask
from llmrl.tasks import Example, Task
from llmrl.training.distributed import Dist


@torch.no_grad()
def evaluate(
    model, tokenizer, task: Task, examples: list[Example], *, batch_size: int, max_prompt_tokens: int,
    min_new_tokens: int, max_new_tokens: int, merge_lora: bool = True, dist: Dist | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy-decode every example; return (metrics named eval/…, one sample row per example).
    With several ranks, each decodes a contiguous shard and the texts are gathered."""
    dist = dist or Dist()
    per_rank = -(-len(examples) // dist.world)
    mine = examples[dist.rank * per_rank : (dist.rank + 1) * per_rank]
    was_training = model.training
    model.eval()
    eos = eos_ids(model, tokenizer)
    config = generation_config(
        tokenizer, eos, do_sample=False, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens,
    )
    device = next(model.parameters()).device
    texts: list[str] = []
    truncated = 0
    for i in range(0, len(mine), batch_size):
        chunk = mine[i : i + batch_size]
        ids, mask, _ = encode_prompts(tokenizer, [ex.messages for ex in chunk], max_prompt_tokens, device)
        with merged_lora(model, merge_lora):
            sequences, _ = generate(model, ids, mask, 1, config)
        cmask, ended = completion_mask(sequences, ids.shape[1], eos)
        texts += decode_completions(tokenizer, sequences[:, ids.shape[1] :], cmask.sum(1), ended)
        truncated += int((~ended).sum())
    model.train(was_training)
    gathered = dist.gather((texts, truncated))
    texts, truncated = [t for part, _ in gathered for t in part], sum(n for _, n in gathered)
    if hasattr(task, "reward_batch"):
        rewards = task.reward_batch(examples, texts)
    else:
        rewards = [task.reward(ex, t) for ex, t in zip(examples, texts, strict=True)]
    metrics = {f"eval/{k}": v for k, v in task.evaluate(examples, texts).items()}
    n = max(len(examples), 1)
    metrics["eval/reward"] = sum(r.total for r in rewards) / n
    metrics["eval/truncated_frac"] = truncated / n
    rows = [
        {"prompt": ex.messages[-1]["content"], "answer": ex.answer, "completion": t, "reward": r.total}
        for ex, t, r in zip(examples, texts, rewards)
    ]
    return metrics, rows
