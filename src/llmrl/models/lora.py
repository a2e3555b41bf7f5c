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
    Anything but one plain active adapter in its own dtype goes to PEFT's forward."""
    adapters = self.active_adapters
    name = adapters[0] if len(adapters) == 1 else None
    a, b = (self.lora_A[name], self.lora_B[name]) if name in self.lora_A else (None, None)
    if (a is None or args or kwargs or self.disable_adapters or self.merged or name in self.lora_variant
            or torch.is_autocast_enabled(x.device.type) or b.bias is not None
            or not x.dtype == a.weight.dtype == b.weight.dtype == self.get_base_layer().weight.dtype):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    h = a(self.lora_dropout[name](x))  # [..., r]
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), b.weight.t(), alpha=self.scaling[name])
    return out.view(result.shape)


def fuse_lora_outputs(model) -> int:
    """Give every PEFT LoRA Linear of `model` the one-addmm forward (`_addmm_forward`); returns how many.
    The same outputs and gradients up to fp32 rounding (measured: equal log-probs on the embedded model)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for m in model.modules():
        if type(m) is LoraLinear and "forward" not in m.__dict__:
            m.forward = types.MethodType(_addmm_forward, m)
            count += 1
    return count
