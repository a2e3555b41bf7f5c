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
        self.model = model
        self.params = list(model.parameters())  # tied weights appear once
        self.copies = [p.detach().clone() for p in self.params]

    @contextmanager
    def swapped_in(self) -> Iterator[torch.nn.Module]:
        """Inside the block the model's parameters hold the reference weights; after it, the policy's again."""
        policy = [p.data for p in self.params]
        try:
            for p, ref in zip(self.params, self.copies):
                p.data = ref
            yield self.model
        finally:
            for p, data in zip(self.params, policy):
                p.data = data


class ShardedReference:
    """The reference of a sharded (FSDP2) full-weight policy: a second, frozen copy of the base, sharded like the
    policy (1/N per rank) and gathered for its forwards."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @contextmanager
    def swapped_in(self) -> Iterator[torch.nn.Module]:
        from llmrl.training.fsdp import gathered

        with gathered(self.module):
            yield self.module


def is_full(model) -> bool:
    """True for a full-weight policy (a plain transformers model), False for a PEFT-wrapped LoRA policy."""
    return not hasattr(model, "disable_adapter")


@contextmanager
def reference_policy(model) -> Iterator[torch.nn.Module]:
    """`with reference_policy(model) as ref:` ref computes the reference policy: `model` with LoRA disabled (an
    adapter), or with the frozen base weights swapped in (full weights, prepared with kl_coef > 0), or the sharded
    frozen copy of the base (full weights on FSDP2)."""
    if not is_full(model):
        with model.disable_adapter():
            yield model
        return
    reference = getattr(model, "llmrl_reference", None)
    if reference is None:
        raise RuntimeError("a full-weight policy without its frozen reference (prepare_full with reference=True)")
    with reference.swapped_in() as module:
        yield module


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
