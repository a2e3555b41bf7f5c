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
                      max_sequences=max(cfg.rollout_size, cfg.eval_batch_size * cfg.eval_samples_per_prompt),
                      scratch=cfg.output_dir)


def _vllm_server_engine(tokenizer, sampling: Sampling, cfg, plan):
    import atexit
    from pathlib import Path

    from llmrl.models.loading import resolve_model_path
    from llmrl.rollout.vllm_engine import kv_cache_bytes
    from llmrl.rollout.vllm_server import VLLMServer, VLLMServerEngine, client_key, free_port, serve_command

    command, key = None, None
    if cfg.server_url is None:
        path = resolve_model_path(cfg.model)
        from transformers import AutoConfig

        turns = cfg.max_turns or 4  # environments: replies and environment messages after the prompt
        max_len = cfg.max_prompt_tokens + turns * (cfg.max_new_tokens + cfg.max_env_tokens + 16)
        max_len = min(max_len, getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None) or max_len)
        kv = kv_cache_bytes(path, cfg.rollout_size, max_len, plan.dtype) if plan.device.type == "cpu" else None
        command = serve_command(path, port=free_port(), lora_r=cfg.lora_r, max_loras=2, seed=cfg.seed, max_len=max_len,
                                dtype=str(plan.dtype).removeprefix("torch."), cpu_kv_bytes=kv)
    else:
        key = client_key(cfg.api_key_file)  # a child server gets a fresh key of its own
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    server = VLLMServer(command, cfg.server_url, Path(cfg.output_dir) / "vllm-server.log", key=key)
    engine = VLLMServerEngine(tokenizer, sampling, server, scratch=cfg.output_dir)
    atexit.register(engine.close)
    return engine


ENGINES = {
    "hf": lambda tokenizer, sampling, cfg, plan: HFEngine(tokenizer, sampling, eval_batch_size=cfg.eval_batch_size,
                                                          merge_lora=plan.merge_lora, sampler_logp=plan.sampler_logp),
    "vllm": _vllm_engine,
    "vllm-server": _vllm_server_engine,
}


def make_engine(cfg, plan, tokenizer) -> RolloutEngine:
    """The engine a TrainConfig and its Plan ask for."""
    sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        repetition_penalty=cfg.repetition_penalty, min_new_tokens=cfg.min_new_tokens,
                        max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens)
    return ENGINES[plan.engine](tokenizer, sampling, cfg, plan)


__all__ = ["ENGINES", "HFEngine", "Rollout", "RolloutEngine", "Sampling", "add_logprobs", "make_engine"]
