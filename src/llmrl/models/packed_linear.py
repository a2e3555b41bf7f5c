"""Frozen fp32 linear layers on CPU through oneDNN with pre-packed weights, in fp32 or in bf16.

PyTorch's CPU `F.linear` calls MKL's sgemm, which repacks the weight on every call and, on some
CPUs (measured here: an AMD EPYC with AVX-512), runs a slower code path: 215–234 GFLOP/s on a
2048² product where oneDNN with a pre-packed weight reaches ~505. For the skinny products of
decoding (16 rows) the gap is 3×. The base weights of a LoRA policy never change, so they are
packed once (`install_packed_linears`); a module whose weight tensor is swapped for another (LoRA
merged for sampling) gets a temporary pack of that tensor, dropped by `release_temporary_packs`.
PEFT's merge/unmerge (and so merge_and_unload) change base weights in place: they repack. Any other
in-place edit of a packed frozen weight must be followed by `uninstall_packed_linears` (a pack is
found by the weight's storage address, which such an edit does not change).

Same arithmetic up to summation order (outputs differ from F.linear by ~1e-6 relative). The bf16
packs (CPUs with a native bf16 unit, `cpu_auto_precision`) are oneDNN packs of bf16 copies: AMX
needs the weight re-laid out, which plain bf16 F.linear does on every call; pre-packed, the decode
products (16 rows) measured 1.3–1.7× faster and a 1024-row product 1.0–1.7× (Xeon model 167).
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
import types

import torch
from torch import nn

from llmrl.run_files import cache_root


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed fp32 linear (x86 CPU builds do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN's packed linear takes bf16 here (it needs AVX-512 or AMX; checked by running it once)."""
    if not onednn_available():
        return False
    try:
        w, x = torch.ones(8, 16, dtype=torch.bfloat16), torch.ones(3, 16, dtype=torch.bfloat16)
        return bool((packed_matmul(x, pack_weight(w), None) == 16).all())
    except RuntimeError:
        return False


def pack_weight(w: torch.Tensor, rows_hint: int = 64) -> torch.Tensor:
    """oneDNN's packed form of a [out, in] fp32 weight, for `x @ w.T` with x [M, in] (any M)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), rows_hint)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ W.T (+ bias) → [M, out] with W given as `pack_weight(W)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Packed:
    """The packs of one weight tensor: forward (W) now, backward (W.T, for grad wrt the input) on
    first need. With `bf16` they are oneDNN packs of bf16 roundings of W and W.T (plain bf16 copies
    where this torch has no oneDNN). Holds the tensor itself, so its memory (and data_ptr) cannot be
    reused while the pack exists: a pack is found again by data_ptr only for the tensor it was made from."""

    def __init__(self, weight: torch.Tensor, bf16: bool = False):
        self.source = weight.detach()
        self.ptr = self.source.data_ptr()
        self.bf16 = bf16
        self.onednn = not bf16 or onednn_bf16_available()
        self.forward = self._pack(self.source)
        self._backward: torch.Tensor | None = None

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            w = w.to(torch.bfloat16)
        return pack_weight(w) if self.onednn else w.contiguous()

    @property
    def backward(self) -> torch.Tensor:
        if self._backward is None:
            # without oneDNN, F.linear(g, W.T-as-a-view) is g @ W with no second copy
            self._backward = self._pack(self.source.t()) if self.onednn else self.forward.t()
        return self._backward

    def matmul(self, x: torch.Tensor, pack: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] @ (the weight `pack` was made from).T (+ bias)."""
        return packed_matmul(x, pack, bias) if self.onednn else nn.functional.linear(x, pack, bias)


class _PackedLinearFn(torch.autograd.Function):
    """y = x @ W.T + b for a frozen W (and b): gradient for x only. With bf16 packs, x and the
    incoming gradient are rounded to bf16 for the products, which accumulate in fp32 inside the
    kernel and come out rounded to bf16, then are returned as fp32 (the bias added in fp32):
    activations, residual sums and the LoRA branch stay fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packs: Packed, bias: torch.Tensor | None) -> torch.Tensor:
        if ctx is not None:
            ctx.packs = packs
        if packs.bf16:
            y = packs.matmul(x.to(torch.bfloat16), packs.forward).float()
            return y if bias is None else y + bias
        return packed_matmul(x, packs.forward, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        packs = ctx.packs
        if packs.bf16:
            return packs.matmul(grad.to(torch.bfloat16).contiguous(), packs.backward).float(), None, None
        return packed_matmul(grad.contiguous(), packs.backward, None), None, None


class PackCache:
    """One module's packs: `base` (its weight when installed) and at most one `temporary` pack."""

    def __init__(self, weight: torch.Tensor, bf16: bool = False):
        self.bf16 = bf16
        self.base = Packed(weight, bf16)
        self.temporary: Packed | None = None

    def get(self, weight: torch.Tensor) -> Packed:
        ptr = weight.data_ptr()
        if self.base.ptr == ptr:
            return self.base
        if self.temporary is None or self.temporary.ptr != ptr:
            self.temporary = Packed(weight, self.bf16)
        return self.temporary


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = self.weight, self.bias
    if (w.requires_grad or (b is not None and b.requires_grad) or x.dtype != torch.float32
            or w.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0 or torch.is_autocast_enabled("cpu")):
        return nn.functional.linear(x, w, b)
    x2, packs = x.reshape(-1, x.shape[-1]), self._llmrl_packs.get(w)
    # no graph to record (sampling, scoring): the forward alone, without autograd.Function's overhead
    y = _PackedLinearFn.apply(x2, packs, b) if torch.is_grad_enabled() and x.requires_grad else _PackedLinearFn.forward(None, x2, packs, b)
    return y.view(*x.shape[:-1], y.shape[-1])


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def packable_linears(model: nn.Module) -> list[nn.Linear]:
    """The frozen fp32 CPU nn.Linear modules of `model` not packed yet (LoRA base layers, the LM head)."""
    return [m for m in model.modules()
            if isinstance(m, nn.Linear) and not hasattr(m, "_llmrl_packs") and m.weight.device.type == "cpu"
            and m.weight.dtype == torch.float32 and not m.weight.requires_grad
            and (m.bias is None or not m.bias.requires_grad)]


def packs_fit(weight_bytes: int, bf16: bool, budget: int | None) -> bool:
    """Whether packs of `weight_bytes` of fp32 frozen weights fit in `budget` bytes (None: no limit): W and W.T,
    twice the weights in fp32, once in bf16."""
    return budget is None or (1 if bf16 else 2) * weight_bytes <= budget


def install_packed_linears(model: nn.Module, memory_budget: int | None = None, bf16: bool = False) -> int:
    """Route every frozen fp32 CPU nn.Linear of `model` (LoRA base layers, the LM head) through
    oneDNN packed weights, or with `bf16` through packed bf16 copies of them (bf16 products, fp32
    in and out); packs its current weights now. Returns how many modules; 0 where oneDNN is missing, or
    where the packs (W for forward, W.T for backward: twice the frozen weights, or once in bf16)
    would exceed `memory_budget` bytes: nothing changes then. Trainable linears (LoRA A
    and B) keep F.linear."""
    if not bf16 and not onednn_available():
        return 0
    layers = packable_linears(model)
    unique = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size() for m in layers}
    if not packs_fit(sum(unique.values()), bf16, memory_budget):
        return 0
    for m in layers:
        m._llmrl_packs = PackCache(m.weight, bf16)
        m.forward = types.MethodType(_packed_forward, m)
    for m in model.modules():  # PEFT's merge/unmerge edit the base weight in place: pack it again after
        base = getattr(m, "base_layer", None)
        if isinstance(base, nn.Linear) and hasattr(base, "_llmrl_packs"):
            for name in ("merge", "unmerge"):
                if callable(getattr(m, name, None)) and name not in m.__dict__:
                    setattr(m, name, _repacking(getattr(m, name), base))
    return len(layers)


def _repacking(method, layer: nn.Linear):
    """`method`, then a fresh pack of `layer`'s weight (which `method` may have changed in place)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            layer._llmrl_packs = PackCache(layer.weight, layer._llmrl_packs.bf16)

    return run


def release_temporary_packs(model: nn.Module) -> None:
    """Drop the packs of swapped-in weights (e.g. merged LoRA copies) and the tensors they hold."""
    for m in model.modules():
        cache = getattr(m, "_llmrl_packs", None)
        if cache is not None:
            cache.temporary = None


def uninstall_packed_linears(model: nn.Module) -> None:
    """Undo `install_packed_linears`: F.linear again, packs freed."""
    for m in model.modules():
        if hasattr(m, "_llmrl_packs"):
            del m._llmrl_packs
            if "forward" in m.__dict__:
                del m.forward
        for name in ("merge", "unmerge"):
            m.__dict__.pop(name, None)


def packing_pays(out_features: int, in_features: int, rows: tuple[int, ...] = (16, 256),
                 seconds: float = 0.02) -> tuple[bool, dict[str, float]]:
    """Time F.linear (MKL sgemm on x86) against oneDNN with a pre-packed weight on this CPU, for a
    frozen [out, in] weight and inputs of `rows` rows (decoding and training sizes), each for about
    `seconds` after a warm-up. Returns (packing is ≥ 5 % faster over the sum, GFLOP/s per kernel).
    Takes ~4·len(rows)·seconds; on an AMD EPYC packing was 2× F.linear, on an Intel Xeon with AMX no faster."""
    if not onednn_available():
        return False, {}
    g = torch.Generator().manual_seed(0)  # not the global stream: the trainer's RNG must not move
    w = torch.randn(out_features, in_features, generator=g)
    packed = pack_weight(w)
    kernels = {"F.linear": lambda x: torch.nn.functional.linear(x, w), "onednn_packed": lambda x: packed_matmul(x, packed, None)}
    times = dict.fromkeys(kernels, 0.0)
    flop = 0.0
    for m in rows:
        x = torch.randn(m, in_features, generator=g)
        flop += 2.0 * m * in_features * out_features
        for name, run in kernels.items():
            run(x)
            best = float("inf")
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:  # the fastest of many calls: robust to a noisy neighbour
                t0 = time.perf_counter()
                run(x)
                best = min(best, time.perf_counter() - t0)
            times[name] += best
    rates = {name: flop / t / 1e9 for name, t in times.items()}
    return times["onednn_packed"] < 0.95 * times["F.linear"], rates


def packing_pays_for(model: nn.Module) -> tuple[bool, str]:
    """`packing_pays` on the shape that holds most of `model`'s frozen linear weights (an MLP matrix,
    not the LM head): (pays, one line saying what was chosen and the measured rates).

    The verdict is measured once per machine, shape and torch build and kept in the llmrl cache
    (`kernels.json`), so every run here (a resumed one, a rerun, the reference of a comparison)
    makes the same choice and computes the same numbers; delete the file to measure again (a verdict measured
    under load is provisional: `_cached_verdict`)."""
    weight: Counter = Counter()
    for m in packable_linears(model):
        weight[tuple(m.weight.shape)] += m.weight.numel()
    shape = weight.most_common(1)[0][0]
    v = packing_verdict(shape)
    measured = ", ".join(f"{k} {r:.0f}" for k, r in v["gflops"].items()) or "no oneDNN"
    return v["pays"], (f"frozen linears: {'oneDNN packed' if v['pays'] else 'F.linear'} (measured on {shape}: "
                       f"{measured} GFLOP/s; {_verdicts_path()}){_verdict_note(v)}")


def packing_verdict(shape: tuple[int, int]) -> dict:
    """{"pays", "gflops"}: whether oneDNN packing pays on an [out, in] weight here (measured once per machine)."""
    return _cached_verdict(f"{shape[0]}x{shape[1]}", lambda: packing_pays(*shape))


def _cached_verdict(what: str, measure) -> dict:
    """{"pays", "gflops"} of a kernel comparison on this machine (CPU model, torch build, threads):
    measured by `measure() -> (pays, rates)` the first time, read from `kernels.json` after. Other processes'
    load is read first (`llmrl.threads.measure_others`, 0.3 s): a verdict measured while they use over
    LOADED_CORES is kept marked "provisional" (with "others": their cores), reused by runs under load, and
    measured again by the next quiet run, which keeps its verdict for good."""
    from llmrl.threads import LOADED_CORES, measure_others

    path = _verdicts_path()
    key = f"{_cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{what}"
    verdicts = _read_json(path)
    if key in verdicts and not verdicts[key].get("provisional"):
        return verdicts[key]
    reading = measure_others()
    loaded = reading is not None and reading[0] > LOADED_CORES
    if key in verdicts and loaded:
        return verdicts[key]  # still under load: the same provisional verdict as the runs before
    pays, rates = measure()
    verdicts[key] = {"pays": pays, "gflops": {k: round(v, 1) for k, v in rates.items()}}
    if loaded:
        verdicts[key] |= {"provisional": True, "others": round(reading[0], 1)}
    _write_json(path, verdicts)
    return verdicts[key]


def _verdict_note(v: dict) -> str:
    """What a line adds for a verdict measured under load (nothing for a kept one)."""
    return (f" (measured under load, other processes using {v.get('others', '?')} cores: provisional, a quiet run "
            "measures again)") if v.get("provisional") else ""


BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of a native bf16 multiply unit
BF16_MATMULS = "bf16 products for the frozen weights (weights, activations, LoRA, optimizer and log-softmax fp32)"
CPU_DTYPE_ENV = "LLMRL_CPU_DTYPE"  # float32 or bfloat16: what dtype=auto picks on CPU, without measuring


def cpu_bf16_flags() -> list[str]:
    """The native-bf16 flags this CPU reports (empty off Linux/x86 or without such a unit)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in BF16_FLAGS if f in flags]


def bf16_pays(out_features: int = 1536, in_features: int = 576, rows: tuple[int, ...] = (16, 256),
              seconds: float = 0.02) -> tuple[bool, dict[str, float]]:
    """Time F.linear in fp32 against bf16 on an [out, in] weight (the embedded model's MLP shape) for
    inputs of `rows` rows: (bf16 is ≥ 1.5× faster over the sum, GFLOP/s per precision). With AMX
    bf16 was 2-6× fp32 here; emulated bf16 is slower than fp32."""
    g = torch.Generator().manual_seed(0)  # not the global stream: the trainer's RNG must not move
    times, flop = {"fp32": 0.0, "bf16": 0.0}, 0.0
    for m in rows:
        flop += 2.0 * m * in_features * out_features
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            w = torch.randn(out_features, in_features, generator=g).to(dtype)
            x = torch.randn(m, in_features, generator=g).to(dtype)
            torch.nn.functional.linear(x, w)
            best, t_end = float("inf"), time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                best = min(best, time.perf_counter() - t0)
            times[name] += best
    return times["bf16"] < times["fp32"] / 1.5, {name: flop / t / 1e9 for name, t in times.items()}


def cpu_auto_precision() -> tuple[bool, str]:
    """Whether `dtype: auto` runs the frozen matmuls in bf16 on this CPU (fp32 weights, activations,
    LoRA and optimizer kept), and one line saying why: where the CPU has a native bf16 unit and a
    start-up measurement (cached like the packing verdict) finds bf16 products ≥ 1.5× faster than
    fp32. LLMRL_CPU_DTYPE=float32|bfloat16 decides instead."""
    forced = os.environ.get(CPU_DTYPE_ENV, "").strip()
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_DTYPE_ENV}={forced!r}: must be float32 or bfloat16")
        return forced == "bfloat16", f"precision: {BF16_MATMULS if forced == 'bfloat16' else 'float32'} ({CPU_DTYPE_ENV}={forced})"
    flags = cpu_bf16_flags()
    if not flags:
        return False, "precision: float32 (this CPU has no native bf16 unit: no amx_bf16 / avx512_bf16 flag)"
    v = _cached_verdict("bf16 vs fp32 1536x576", bf16_pays)
    rates = ", ".join(f"{k} {r:.0f}" for k, r in v["gflops"].items())
    return v["pays"], (f"precision: {BF16_MATMULS if v['pays'] else 'float32'} ({'+'.join(flags)}; measured F.linear "
                       f"{rates} GFLOP/s; {_verdicts_path()}){_verdict_note(v)}")


def _verdicts_path():
    return cache_root() / "kernels.json"


def _cpu_name() -> str:
    """The CPU's model name and number (/proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "model name" in fields:
            return f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _read_json(path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path, data: dict) -> None:
    """Atomic write (a temporary file renamed), so concurrent runs never read half a file."""
    import json
    import os
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only means measuring again next time
