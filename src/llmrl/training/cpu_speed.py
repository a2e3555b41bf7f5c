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


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's mallopt(param, value) for each pair; False where there is no glibc (macOS, musl) or it refuses one."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(bool(libc.mallopt(param, value)) for param, value in settings)
    except (OSError, AttributeError):
        return False


def keep_heap_memory() -> bool:
    """Ask glibc malloc to serve big blocks from the heap and to keep freed memory (mallopt), so
    activations that are freed and reallocated every step reuse pages instead of faulting in
    fresh zeroed ones. The process keeps its peak memory until it exits. Returns False where
    there is no glibc (macOS, musl): nothing changes there."""
    return _mallopt((M_MMAP_THRESHOLD, 2**30), (M_TRIM_THRESHOLD, INT_MAX))


def return_heap_memory() -> bool:
    """Ask glibc malloc to serve every block of 256 KiB or more by its own mmap, given back to the system when freed
    (a fixed threshold: glibc's default raises it after each such free, up to 32 MiB, and then keeps freed blocks
    in its heap). Under FSDP2 every step all-gathers whole blocks and frees them again; kept, they would make each
    rank's resident memory the sum of every buffer it ever held, not its live tensors (measured: 4.2 GiB against
    2.5 GiB on the embedded model, 2 ranks, full weights). Returns False where there is no glibc."""
    return _mallopt((M_MMAP_THRESHOLD, 256 << 10))


_COUNTER = torch.arange(0, dtype=torch.int64)
M64 = 2**64


def hash_fields(n: int, key: int) -> torch.Tensor:
    """n pseudo-random int16 values, uniform over all 2^16, from a keyed counter hash: the splitmix64
    finaliser of key + i·golden for i < ⌈n/4⌉, each 64-bit result read as four 16-bit fields
    (vectorised, no sequential generator state; a quarter of the elements hashed). key: int64."""
    global _COUNTER
    m = -(-n // 4)
    if _COUNTER.numel() < m:
        _COUNTER = torch.arange(max(m, 2 * _COUNTER.numel()), dtype=torch.int64)
    z = _COUNTER[:m] * (0x9E3779B97F4A7C15 - M64)  # int64 wraps: the arithmetic is mod 2^64
    z += key
    # xor-shift-multiply rounds (logical shifts: the arithmetic shift's sign bits masked off)
    z ^= (z >> 30) & ((1 << 34) - 1)
    z *= 0xBF58476D1CE4E5B9 - M64
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= 0x94D049BB133111EB - M64
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z.view(torch.int16)[:n]


class HashDropout(nn.Module):
    """Dropout whose mask comes from `hash_fields` instead of a per-element Mersenne-twister draw.

    Each element is kept with probability 1 - p', p' = round(p·2^16)/2^16 (|p' - p| ≤ 2^-17: 0.05 →
    0.0500031), kept ones scaled by 1/(1 - p) as nn.Dropout does. One 64-bit hash gives four decisions,
    and the mask is applied as x·scale (scale 0 or 1/(1-p), computed without comparisons): ~4x faster
    than nn.Dropout on CPU (measured on [320, 576]: 0.28 vs 1.24 ms, AMD EPYC Zen 4). Each call takes
    its key from torch's default generator, so torch.manual_seed and saved RNG states reproduce the
    masks exactly.
    """

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.threshold = -(2**15) + round(p * 2**16)  # keep where the 16-bit field >= threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        key = int(torch.randint(-(2**62), 2**62, (1,)))
        # keep where field >= threshold, as arithmetic: clamped into {t-1, t} and shifted, each field
        # becomes exactly 0 or 1 (fp32 holds every int16 ± 1). CPU comparisons, bool tensors and
        # torch.where run 5-20x slower per element than these four passes (measured: ge + where 410 µs,
        # these 50 µs on [320, 576])
        t = self.threshold
        scale = hash_fields(x.numel(), key).float().clamp_(t - 1, t).sub_(t - 1).mul_(1.0 / (1.0 - self.p))
        return x * scale.view(x.shape).to(x.dtype)

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
