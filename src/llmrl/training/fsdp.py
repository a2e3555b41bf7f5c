"""FSDP2 sharding (`--shard fsdp`, with torchrun): each rank holds 1/W of every weight, of its gradient and of
its AdamW state, through PyTorch's own `torch.distributed.fsdp.fully_shard` (DTensor parameters).

How llmrl's loop runs on a sharded policy:

    shard_policy     each transformer block (the model's `_no_split_modules` classes) is fully_shard'ed, then the
                     root; gradients are reduce-scattered as sums (the ranks' losses are their shares of the
                     global minibatch's, as with DDP: distributed.py), on gloo too (no PREMUL_SUM there)
    gathered(model)  generation, the old/reference log-prob forwards and eval run on the unsharded module: one
                     all-gather of every block before, a reshard after. Ranks sample different completion
                     lengths, so their forward counts differ; forwards of an unsharded module need no
                     collectives, so nothing waits on a rank that stopped early. The whole model is held
                     unsharded for those phases (W× the sharded parameters), not the gradients or AdamW state.
    backward_in_step the update's forwards are sharded (an all-gather per block, a reduce-scatter per backward):
                     every rank must run as many backwards in an optimizer window, so a rank with fewer pieces
                     (or a non-finite loss) runs zero-loss backwards (`zero_backward`) to keep step.
    checkpoints      full weights: each rank writes its own shards of the model and AdamW state through
                     `torch.distributed.checkpoint` (DCP: `__<rank>_0.distcp` files and `.metadata` in the checkpoint
                     directory), nothing gathered; DCP reshards on load, so it resumes on any number of ranks,
                     sharded or not, and `llmrl export` consolidates it. LoRA: the adapter and its AdamW state are
                     small, gathered to rank 0 (`full_state`) and written as an unsharded run's checkpoint
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from llmrl.errors import ConfigError


def fsdp_modules(model) -> list:
    """The fully_shard'ed modules of `model` (none when it is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    return bool(fsdp_modules(model))


def shard_policy(model, world: int) -> int:
    """fully_shard each transformer block of `model` (a transformers model, or a PEFT model around one: LoRA's
    frozen base is sharded with its adapters), then the root, over all ranks; returns the number of blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    block_classes = set(getattr(inner, "_no_split_modules", None) or [])
    blocks = [m for m in inner.modules() if type(m).__name__ in block_classes]
    if not blocks:
        from llmrl.errors import ConfigError

        raise ConfigError(f"shard=fsdp: {type(inner).__name__} names no transformer block class (_no_split_modules) "
                          "to shard by: use --shard ddp")
    device = next(inner.parameters()).device
    mesh = init_device_mesh(device.type, (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(inner, mesh=mesh)
    for m in fsdp_modules(inner):
        m.set_gradient_divide_factor(1.0)  # sum the ranks' gradients (each loss is its share of the global one)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM reduce-scatter (gloo has no PREMUL_SUM)
    return len(blocks)


@contextmanager
def gathered(model) -> Iterator[None]:
    """Inside the block `model`'s parameters are whole on every rank and its forwards run no collectives (generate,
    scoring, eval); resharded after. A no-op for a model that is not sharded. Every rank must enter it together."""
    modules = fsdp_modules(model)
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.unshard()
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def zero_backward(model) -> None:
    """A forward and backward of one token with a zero loss: the same all-gathers and reduce-scatters as a real
    piece, adding nothing to any gradient (keeps a rank in step with ranks that have more pieces)."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
    (out.float().sum() * 0.0).backward()


def total_norm(norm) -> float:
    """clip_grad_norm_'s result as a float (a DTensor for sharded gradients)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def full_state(model, optimizer) -> tuple[dict, dict] | None:
    """A sharded LoRA policy's (adapter state, optimizer state): whole tensors on the CPU of rank 0 (None on the
    others), keyed by parameter name, what an unsharded run's checkpoint holds (the frozen base left out). Every rank
    must call it. (Full weights are not gathered: every rank writes its own shards, `save_sharded`.)"""
    import torch.distributed as tdist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    if optimizer.state:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    else:  # before the first step: no AdamW state (get_state_dict would make one by a zero step: see save_sharded)
        model_state = get_model_state_dict(model, options=options)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        index = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        optimizer_state = {"state": {}, "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]} if names else {"state": {}, "param_groups": []}
    return (model_state, optimizer_state) if tdist.get_rank() == 0 else None


def held_bytes(params: list, optimizer) -> int:
    """Bytes this rank holds of the trained parameters, their gradients and the optimizer's state (local shards of
    sharded tensors): what sharding divides by the number of ranks."""
    def local(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum(local(t) for t in tensors)


def save_sharded(model, optimizer, directory) -> None:
    """Every rank writes its shards of the model's weights and the optimizer's state into `directory` (DCP).
    Every rank must call it; a failed write on any rank raises on all of them. Before the first optimizer step (a
    run stopped at step 0) only the weights: get_state_dict would first give AdamW a state by a zero-gradient step,
    whose step count 1 would change the first real update after a resume."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer.state:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))
    else:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(directory))


def load_sharded(directory, model, optimizer=None) -> None:
    """Load a DCP checkpoint's weights (and optimizer state) into `model` (and `optimizer`), sharded or not, on any
    number of ranks (DCP reshards); without a process group each process reads the whole tensors. Read as data only
    (dcp_files: `.metadata` and non-tensor entries through allow-lists); a file that is refused, damaged or does not
    fit the model is one ConfigError line."""
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    from llmrl.dcp_files import failure_line, first_failure, planner, read_metadata, reader

    metadata = read_metadata(Path(directory) / ".metadata")  # refused here, in one line, before DCP logs its failure
    no_dist = not (tdist.is_available() and tdist.is_initialized())
    if not any(key.startswith("optimizer.") for key in metadata.state_dict_metadata):
        optimizer = None  # saved before the first step (save_sharded): the optimizer starts fresh, as it was
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)  # AdamW's state allocated, to be filled
        state = {"model": model_state, "optimizer": optimizer_state}
    try:
        with warnings.catch_warnings():  # one process reading a sharded checkpoint is meant (DCP warns it assumes so)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader(directory), planner=planner(), no_dist=no_dist)
    except BaseException as e:  # DCP wraps every rank's error in its CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause = first_failure(e)
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"checkpoint {directory} could not be read: {failure_line(e)}") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
