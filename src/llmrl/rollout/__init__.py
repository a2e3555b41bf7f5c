"""Rollout engines behind one interface (rollout/base.py): `hf` (Hugging Face generate) and `vllm`
(in-process vLLM, rollout/vllm_engine.py; imported only when asked for)."""

from __future__ import annotations

from llmrl.rollout.base import Rollout, RolloutEngine, Sampling, add_logprobs
from llmrl.rollout.hf import HFEngine


def _vllm_engine(tokenizer, sampling: Sampling, cfg, plan):
    from llmrl.models.loading import resolve_model_path
    from llmrl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(tokenizer, sampling, model_path=resolve_model_path(cfg.model), device=plan.device, dtype=plan.dtype,
                      lora_r=cfg.lora_r, seed=cfg.seed, eval_max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                      memory=cfg.vllm_memory, sleep=cfg.vllm_sleep,
                      max_sequences=max(cfg.rollout_size, cfg.eval_batch_size * cfg.eval_samples_per_prompt))


ENGINES = {
    "hf": lambda tokenizer, sampling, cfg, plan: HFEngine(tokenizer, sampling, eval_batch_size=cfg.eval_batch_size,
                                                          merge_lora=plan.merge_lora, sampler_logp=plan.sampler_logp),
    "vllm": _vllm_engine,
}


def make_engine(cfg, plan, tokenizer) -> RolloutEngine:
    """The engine a TrainConfig and its Plan ask for."""
    sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        repetition_penalty=cfg.repetition_penalty, min_new_tokens=cfg.min_new_tokens,
                        max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens)
    return ENGINES[plan.engine](tokenizer, sampling, cfg, plan)


__all__ = ["ENGINES", "HFEngine", "Rollout", "RolloutEngine", "Sampling", "add_logprobs", "make_engine"]
