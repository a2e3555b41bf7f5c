"""Full-weight training (`--finetune full`): every weight of the policy trains, and the reference policy
of the KL term is the base as it was loaded, not "the adapter switched off".

The reference is kept as a frozen copy of the base's tensors (`FrozenReference`, made only when
kl_coef > 0). A reference forward swaps the copies into the policy's own parameters for the duration
of one no-grad block (`reference_policy`), so the reference runs through the very module the policy
does (same attention kernels, hooks and autocast) and no second module is built; the swap moves no
data (`p.data` is rebound, not copied).

Memory, per rank, without sharding (P parameters): fp32 weights 4P, gradients 4P, AdamW's two moments
8P, the reference 4P when kl_coef > 0: 16P-20P bytes, against ~4P for LoRA (the frozen base).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class FrozenReference:
    """Detached copies of `model`'s parameters as they are now (the base before any step)."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())  # tied weights appear once
        self.copies = [p.detach().clone() for p in self.params]

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the model's parameters hold the reference weights; after it, the policy's again."""
        policy = [p.data for p in self.params]
        try:
            for p, ref in zip(self.params, self.copies):
                p.data = ref
            yield
        finally:
            for p, data in zip(self.params, policy):
                p.data = data


def is_full(model) -> bool:
    """True for a full-weight policy (a plain transformers model), False for a PEFT-wrapped LoRA policy."""
    return not hasattr(model, "disable_adapter")


def reference_policy(model):
    """Context manager under which `model` computes the reference policy: LoRA disabled for an adapter, the
    frozen base weights swapped in for a full-weight policy (which must have been prepared with kl_coef > 0)."""
    if not is_full(model):
        return model.disable_adapter()
    reference = getattr(model, "llmrl_reference", None)
    if reference is None:
        raise RuntimeError("a full-weight policy without its frozen reference (prepare_full with reference=True)")
    return reference.swapped_in()


def prepare_full(model, gradient_checkpointing: bool, reference: bool, autocast: torch.dtype | None):
    """Make a loaded transformers model the policy of a full-weight run, in place: every parameter trains, the
    frozen reference copy is taken (when `reference`), gradient checkpointing is on as configured, and every
    forward (training, scoring and generate's) runs under torch.autocast(`autocast`) when one is given
    (weights, gradients and optimizer state stay fp32). Returns the model."""
    from llmrl.models.loading import enable_gradient_checkpointing

    model.requires_grad_(True)
    if reference:
        model.llmrl_reference = FrozenReference(model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if autocast is not None and "forward" not in model.__dict__:
        model.forward = torch.autocast(model.device.type, dtype=autocast)(model.forward)
    return model
