"""Rollout engines behind one interface (rollout/base.py): `hf` (Hugging Face generate) and `vllm`
(in-process vLLM, rollout/vllm_engine.py; imported only when asked for)."""

from __future__ import annotations

from llmrl.rollout.base import Rollout, RolloutEngine, Sampling, add_logprobs
from llmrl.rollout.hf import HFEngine


def context_tokens(cfg, limits) -> int:
    """The longest row a vLLM engine must hold, within the model's positions: the prompt, then one reply
    (training's or eval's cap, whichever is larger) or, for an environment (`limits`: its Limits), every reply
    and environment turn of an episode."""
    from transformers import AutoConfig

    from llmrl.models.loading import resolve_model_path

    reply = max(cfg.max_new_tokens, cfg.eval_max_new_tokens or cfg.max_new_tokens)
    longest = limits.context_tokens(cfg.max_prompt_tokens, reply) if limits is not None else \
        cfg.max_prompt_tokens + reply + 8
    positions = getattr(AutoConfig.from_pretrained(resolve_model_path(cfg.model), trust_remote_code=False),
                        "max_position_embeddings", None)
    return min(longest, positions or longest)


def rank_sequences(cfg, plan) -> int:
    """Sequences one rank's engine holds at once: its share of a step's rollouts (prompts are split over the
    ranks, G rows each) or of an eval batch."""
    prompts = -(-cfg.batch_size // plan.world_size)
    return max(prompts * cfg.group_size, cfg.eval_batch_size * cfg.eval_samples_per_prompt)


def _vllm_engine(tokenizer, sampling: Sampling, cfg, plan, limits):
    from llmrl.models.loading import resolve_model_path
    from llmrl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(tokenizer, sampling, model_path=resolve_model_path(cfg.model), device=plan.device, dtype=plan.dtype,
                      lora_r=cfg.lora_r, seed=cfg.seed, max_len=context_tokens(cfg, limits), memory=cfg.vllm_memory,
                      sleep=cfg.vllm_sleep, max_sequences=rank_sequences(cfg, plan), world_size=plan.world_size,
                      scratch=cfg.output_dir, prefix_caching=cfg.vllm_prefix_caching,
                      full=cfg.finetune == "full")


def _vllm_server_engine(tokenizer, sampling: Sampling, cfg, plan, limits):
    import atexit
    from pathlib import Path

    from llmrl.models.loading import resolve_model_path
    from llmrl.rollout.vllm_engine import kv_cache_bytes
    from llmrl.rollout.vllm_server import VLLMServer, VLLMServerEngine, client_key, free_port, serve_command

    command, key = None, None
    if cfg.server_url is None:
        path = resolve_model_path(cfg.model)
        max_len = context_tokens(cfg, limits)
        kv = kv_cache_bytes(path, rank_sequences(cfg, plan), max_len, plan.dtype) if plan.device.type == "cpu" else None
        command = serve_command(path, port=free_port(), lora_r=cfg.lora_r, max_loras=2, seed=cfg.seed, max_len=max_len,
                                dtype=str(plan.dtype).removeprefix("torch."), cpu_kv_bytes=kv)
    else:
        key = client_key(cfg.api_key_file)  # a child server gets a fresh key of its own
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    server = VLLMServer(command, cfg.server_url, Path(cfg.output_dir) / "vllm-server.log", key=key)
    # every row of a step in flight at once (64 at least: eval batches)
    engine = VLLMServerEngine(tokenizer, sampling, server, scratch=cfg.output_dir,
                              workers=max(64, rank_sequences(cfg, plan)))
    atexit.register(engine.close)
    return engine


ENGINES = {
    "hf": lambda tokenizer, sampling, cfg, plan, limits: HFEngine(tokenizer, sampling,
                                                                  merge_lora=plan.merge_lora, sampler_logp=plan.sampler_logp),
    "vllm": _vllm_engine,
    "vllm-server": _vllm_server_engine,
}


def make_engine(cfg, plan, tokenizer, limits=None) -> RolloutEngine:
    """The engine a TrainConfig and its Plan ask for; `limits`: an environment's episode Limits (a vLLM engine
    sizes its context for whole episodes), None for a single-turn task."""
    sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        repetition_penalty=cfg.repetition_penalty, min_new_tokens=cfg.min_new_tokens,
                        max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens)
    return ENGINES[plan.engine](tokenizer, sampling, cfg, plan, limits)


__all__ = ["ENGINES", "HFEngine", "Rollout", "RolloutEngine", "Sampling", "add_logprobs", "make_engine"]
