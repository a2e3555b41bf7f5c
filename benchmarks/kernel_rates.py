"""GFLOP/s of the frozen-weight products llmrl can use on this CPU, at the embedded model's shapes.

    python benchmarks/kernel_rates.py

For each weight shape [out, in] (an MLP matrix, attention's square one, the LM head, and 2048²) and
each row count (16: a decode step of cpu-bench; 256 and 1024: training forwards), the best of many
calls (~0.3 s each) of: fp32 F.linear (MKL sgemm on x86), fp32 oneDNN with a pre-packed weight, bf16
F.linear, and bf16 oneDNN pre-packed (what `dtype: auto` uses where bf16 pays). In-cache figures: a
decode step streams its weights from memory and runs slower. Then the two start-up verdicts llmrl
caches in kernels.json (bf16 vs fp32, packing vs F.linear), measured afresh.
"""

import time

import torch

from llmrl.models.packed_linear import bf16_pays, onednn_bf16_available, pack_weight, packed_matmul, packing_pays


def rate(fn, flop: float, seconds: float = 0.3) -> float:
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return flop / best / 1e9


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, oneDNN bf16: {onednn_bf16_available()}")
    print(f"{'weight':>12} {'rows':>5} {'fp32 F.linear':>14} {'fp32 packed':>12} {'bf16 F.linear':>14} {'bf16 packed':>12}")
    for out_f, in_f in [(1536, 576), (576, 576), (49152, 576), (2048, 2048)]:
        w = torch.randn(out_f, in_f)
        w16 = w.bfloat16()
        p32, p16 = pack_weight(w), (pack_weight(w16) if onednn_bf16_available() else None)
        for m in (16, 256, 1024):
            x = torch.randn(m, in_f)
            x16 = x.bfloat16()
            flop = 2.0 * m * in_f * out_f
            r = [rate(lambda: torch.nn.functional.linear(x, w), flop), rate(lambda: packed_matmul(x, p32, None), flop),
                 rate(lambda: torch.nn.functional.linear(x16, w16), flop),
                 rate(lambda: packed_matmul(x16, p16, None), flop) if p16 is not None else float("nan")]
            print(f"{f'{out_f}x{in_f}':>12} {m:>5} {r[0]:14.0f} {r[1]:12.0f} {r[2]:14.0f} {r[3]:12.0f}")
    pays, rates = bf16_pays()
    print(f"bf16 verdict (F.linear, 1536x576 at 16 and 256 rows): {'bf16' if pays else 'fp32'}; "
          + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + " GFLOP/s")
    pays, rates = packing_pays(1536, 576)
    print(f"packing verdict (fp32, 1536x576): {'packed' if pays else 'F.linear'}; "
          + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + " GFLOP/s")


if __name__ == "__main__":
    main()
