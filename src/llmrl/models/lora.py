"""LoRA helpers around sampling: the adapter merged into the base weights for fast generation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from llmrl.models.packed_linear import release_temporary_packs


@contextlib.contextmanager
def merged_lora(model, enabled: bool = True) -> Iterator[None]:
    """Sample with LoRA merged into the base weights (one matmul per layer instead of three): each
    adapted layer gets a merged copy W + ΔW as its weight while inside, and its own base weight
    tensor back (untouched, bit for bit) after. Plain LoRA layers only: other layers (or other PEFT
    versions' layers) stay unmerged."""
    layers = []
    if enabled:
        for m in model.modules():
            if (hasattr(m, "get_delta_weight") and hasattr(m, "base_layer") and not getattr(m, "merged", True)
                    and not getattr(m, "lora_variant", {}) and not any(getattr(m, "lora_bias", {}).values())):
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


