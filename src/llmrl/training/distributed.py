"""Data parallelism on torch.distributed (torchrun): gloo on CPU, NCCL on GPUs.

What is global and what is per rank:
    batch_size, minibatch_size   global: rank r samples prompts [r·B/W, (r+1)·B/W) of the global draw
                                 and trains on its rows of each global minibatch
    grad_accum_steps, ppo_epochs same on every rank (global minibatches per optimizer step, passes)
    group_size                   a prompt's whole group lives on one rank: advantages need no traffic

Every rank draws the same global prompts (the task RNG is seeded by `seed` alone), samples its own
prompts with noise keyed by the global prompt index, and computes its rows' share of each global
minibatch's loss, scaled so that the SUM of the ranks' gradients is the gradient of the global
minibatch (`all_reduce_grads` sums them): N ranks with per-rank minibatch m update exactly like one
process with minibatch N·m. Only LoRA gradients travel; the PEFT model is not wrapped in DDP so that
`generate` and `disable_adapter` work unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from llmrl.config import launched_world_size
from llmrl.errors import ConfigError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of n items (n divisible by world)."""
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank."""
        return any(self.gather(bool(flag))) if self.enabled else bool(flag)

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def close(self) -> None:
        """Leave the process group together: a rank that tears it down while another still works
        (rank 0 writing the last checkpoint) can abort at exit in gloo's threads."""
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def init_distributed(device: str, timeout_s: float) -> Dist:
    """Join the torchrun process group if WORLD_SIZE > 1 (gloo on CPU, NCCL on CUDA)."""
    world = launched_world_size()
    dist = Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1:
        return dist
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r}: CUDA was requested but no GPU is visible")
        if dist.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={dist.local_rank}: only {torch.cuda.device_count()} GPUs on this node")
        torch.cuda.set_device(dist.local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist


def all_reduce_grads(params: list[torch.nn.Parameter], bad: bool, dist: Dist) -> bool:
    """Sum the ranks' gradients of `params` in place (one flat all-reduce) and OR their `bad` flags."""
    if not dist.enabled:
        return bad
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([float(bad)], device=grads[0].device, dtype=grads[0].dtype)])
    torch.distributed.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()
    return bool(flat[-1].item() > 0)


LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def lost_peer(e: BaseException) -> str | None:
    """Under torchrun, a collective that failed because another rank went away (it stopped with its own line, or was
    killed, which the launcher says): the first line of the backend's error; else None."""
    if launched_world_size() == 1 or not isinstance(e, RuntimeError):
        return None
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    is_backend = isinstance(e, getattr(torch.distributed, "DistError", ())) or "gloo" in text or "NCCL" in text
    return first if is_backend and any(mark in text for mark in LOST_PEER) else None
