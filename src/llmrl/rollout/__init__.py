"""Rollout engines behind one interface (rollout/base.py): `hf` (Hugging Face generate)."""

from __future__ import annotations

from llmrl.rollout.base import Rollout, RolloutEngine, Sampling, add_logprobs
from llmrl.rollout.hf import HFEngine

ENGINES = {"hf": HFEngine}


def make_engine(cfg, plan, tokenizer) -> RolloutEngine:
    """The engine a TrainConfig and its Plan ask for."""
    sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        repetition_penalty=cfg.repetition_penalty, min_new_tokens=cfg.min_new_tokens,
                        max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens)
    return ENGINES[plan.engine](tokenizer, sampling, eval_batch_size=cfg.eval_batch_size, merge_lora=plan.merge_lora,
                                sampler_logp=plan.sampler_logp)


__all__ = ["ENGINES", "HFEngine", "Rollout", "RolloutEngine", "Sampling", "add_logprobs", "make_engine"]
