"""Two CPU-only speed-ups that change no arithmetic: heap reuse, and a faster LoRA dropout mask.

Measured on the cpu-bench shapes (one training forward+backward of 16 completions, 2 cores):
page faults from freshly mmapped activations cost ~0.5 s of 3.1 s; PyTorch's CPU dropout draws
every mask element from a serial Mersenne twister (~4 ns each), 0.6 s of the same 3.1 s.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
INT_MAX = 2**31 - 1


def keep_heap_memory() -> bool:
    """Ask glibc malloc to serve big blocks from the heap and to keep freed memory (mallopt), so
    activations that are freed and reallocated every step reuse pages instead of faulting in
    fresh zeroed ones. The process keeps its peak memory until it exits. Returns False where
    there is no glibc (macOS, musl): nothing changes there."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 2**30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, INT_MAX))
    except (OSError, AttributeError):
        return False


_COUNTER = torch.arange(0, dtype=torch.int32)


def hash_bits(n: int, key1: int, key2: int) -> torch.Tensor:
    """n pseudo-random int32 values, uniform over all 2^32, from a keyed integer hash of 0 … n-1
    (counter-based: vectorised, no sequential generator state). key1, key2: int32 keys."""
    global _COUNTER
    if _COUNTER.numel() < n:
        _COUNTER = torch.arange(max(n, 2 * _COUNTER.numel()), dtype=torch.int32)
    v = _COUNTER[:n] ^ key1
    # two xor-shift-multiply rounds (logical shifts by masking the arithmetic ones), key2 between them
    v ^= (v >> 16) & 0xFFFF
    v *= 0x7FEB352D
    v += key2
    v ^= (v >> 15) & 0x1FFFF
    v *= 0x846CA68B - 2**32
    v ^= (v >> 16) & 0xFFFF
    return v


class HashDropout(nn.Module):
    """Dropout whose mask comes from `hash_bits` instead of a per-element Mersenne-twister draw.

    Same distribution as nn.Dropout (each element kept with probability 1 - p, p exact to 2^-32,
    kept ones scaled by 1/(1 - p)); ~2.4x faster on CPU. Each call takes its two keys from torch's
    default generator, so torch.manual_seed and saved RNG states reproduce the masks exactly.
    """

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.threshold = -(2**31) + round(p * 2**32)  # keep where bits >= threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        key1, key2 = torch.randint(-(2**31), 2**31 - 1, (2,)).tolist()
        keep = (hash_bits(x.numel(), key1, key2) >= self.threshold).view(x.shape)
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - self.p)))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def use_hash_dropout(model: nn.Module) -> int:
    """Replace the nn.Dropout modules of PEFT's LoRA layers (`lora_dropout`) by HashDropout with
    the same p; returns how many were replaced. Only for CPU models."""
    replaced = 0
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if not isinstance(drops, nn.ModuleDict):
            continue
        for name, d in list(drops.items()):
            if isinstance(d, nn.Dropout) and d.p > 0:
                drops[name] = HashDropout(d.p)
                replaced += 1
    return replaced
