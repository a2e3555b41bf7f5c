"""LoRA helpers around sampling: the adapter merged into the base weights for fast generation."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from llmrl.models.packed_linear import release_temporary_packs


def merge_is_exact(base: torch.nn.Module) -> bool:
    """Whether a LoRA layer's base multiplies W + ΔW in fp32. A bf16 weight, or fp32 multiplied through
    bf16 copies (CPU bf16 products), would round the merged copy to bf16, whose 8-bit mantissa loses
    much of a small ΔW: measured on the embedded model, one adapter (bf16 run, step 20) scored greedy
    exact-match 0.22 merged into bf16 copies, 0.58 unmerged, 0.52 merged in fp32."""
    packs = getattr(base, "_llmrl_packs", None)
    return base.weight.dtype == torch.float32 and not (packs is not None and packs.bf16)


@contextlib.contextmanager
def merged_lora(model, enabled: bool = True) -> Iterator[None]:
    """Sample with LoRA merged into the base weights (one matmul per layer instead of three): each
    adapted layer gets a merged copy W + ΔW as its weight while inside, and its own base weight
    tensor back (untouched, bit for bit) after. Plain LoRA layers only: other layers (or other PEFT
    versions' layers) stay unmerged, and so do layers whose base weight is multiplied in less than
    fp32 (`merge_is_exact`)."""
    layers = []
    if enabled:
        for m in model.modules():
            if (hasattr(m, "get_delta_weight") and hasattr(m, "base_layer") and not getattr(m, "merged", True)
                    and not getattr(m, "lora_variant", {}) and not any(getattr(m, "lora_bias", {}).values())
                    and merge_is_exact(m.get_base_layer())):
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


def _addmm_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT LoRA Linear's forward with the B product, the scaling and the sum with the base output
    in one addmm: base(x) + s·(A(dropout(x)) @ Bᵀ), the same arithmetic as PEFT's
    `base(x) + B(A(dropout(x))) * s` without its two [tokens, out] temporaries (in backward too).
    The layer's one adapter was looked up once (`fuse_lora_outputs`): a call costs no PEFT property
    or module-call overhead (measured: ~20 µs of each of a decode step's 210 LoRA calls). Adapters
    disabled, merged or switched, autocast or another dtype go to PEFT's forward."""
    name, a, b, dropout, scaling, base = self.__dict__["_llmrl_adapter"]
    if (args or kwargs or self._disable_adapters or self.merged_adapters or self._active_adapter not in (name, [name])
            or torch.is_autocast_enabled(x.device.type)
            or not x.dtype == a.weight.dtype == b.weight.dtype == base.weight.dtype):
        return type(self).forward(self, x, *args, **kwargs)
    result = base(x)
    h = torch.nn.functional.linear(dropout(x) if dropout.training else x, a.weight)  # [..., r]; A has no bias
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), b.weight.t(), alpha=scaling)
    return out.view(result.shape)


def fuse_lora_outputs(model) -> int:
    """Give every PEFT LoRA Linear of `model` with one plain adapter (no DoRA or other variant, no LoRA
    bias) the one-addmm forward (`_addmm_forward`); returns how many. The same outputs and gradients
    up to fp32 rounding (measured: equal log-probs on the embedded model)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for m in model.modules():
        if type(m) is LoraLinear and "forward" not in m.__dict__ and len(m.lora_A) == 1:
            name = next(iter(m.lora_A))
            a, b = m.lora_A[name], m.lora_B[name]
            if name in m.lora_variant or a.bias is not None or b.bias is not None:
                continue
            m._llmrl_adapter = (name, a, b, m.lora_dropout[name], m.scaling[name], m.get_base_layer())
            m.forward = types.MethodType(_addmm_forward, m)
            count += 1
    return count
