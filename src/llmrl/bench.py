"""`llmrl bench`: time llmrl against Hugging Face TRL's GRPOTrainer on the cpu-bench config.

Both sides train the same model on the same prompts with the same settings, each in its own
subprocess (so each side's peak RSS is its own), optionally alternating in rounds so that machine
noise hits both. Per side it reports the median seconds per RL step after dropping each process's
first (warm-up) step, the rollout/update split (and the rollout's generation), completion tokens per
second and peak memory; then the speed ratio TRL/llmrl and llmrl's step time over a FLOP-limit time
computed from the machine's measured matmul rate (see `flop_count`).

The llmrl side is this module run as `python -m llmrl.bench --child llmrl --config_json ...`; the
TRL side is `python -m llmrl.bench_trl ...` (TRL is imported only there). Each prints its figures as
one JSON object on its last stdout line.

Wire into the CLI with `add_bench_parser(sub)` and dispatch `bench` to `cmd_bench(args)`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmrl.config import bool_word
from llmrl.errors import ConfigError
from llmrl.install import pip_install

# The cpu-bench config of SPEC.md: the repository's configs/cpu-bench.yaml (one copy, read at run time).
CPU_BENCH_YAML = Path(__file__).resolve().parents[2] / "configs" / "cpu-bench.yaml"


def cpu_bench() -> dict[str, Any]:
    """The fields of configs/cpu-bench.yaml."""
    from llmrl.config import read_yaml

    if not CPU_BENCH_YAML.is_file():
        raise ConfigError(f"llmrl bench: {CPU_BENCH_YAML} not found (it ships with the repository; "
                          "install with `pip install -e .` or pass --config FILE)")
    return read_yaml(CPU_BENCH_YAML)

# --sweep: (group_size, max_new_tokens) pairs; the first is the cpu-bench setting itself
# (group_size, min_new_tokens, max_new_tokens): None = the config's min_new_tokens; min = max forces the length
SWEEP = [(4, None, 24), (8, None, 24), (16, None, 24), (4, None, 64), (4, None, 128), (4, 128, 128), (4, 512, 512)]

TRL_MISSING = f"TRL not installed: {pip_install('bench')} (or run with --no_trl)"
N_PARAMS_NOTE = "all parameters of the base model (LoRA adapters excluded), embeddings included, tied embeddings once"


def sweep_rows(text: str) -> list[tuple[int, int | None, int]]:
    """`all` → SWEEP; else comma-separated G:MAX or G:MIN:MAX rows → [(group, min_new or None, max_new)]."""
    if text == "all":
        return list(SWEEP)
    rows = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            numbers = [int(x) for x in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3) or min(numbers) < 1:
            raise argparse.ArgumentTypeError(f"sweep row {item!r}: expected G:MAX or G:MIN:MAX with positive integers")
        rows.append((numbers[0], numbers[1] if len(numbers) == 3 else None, numbers[-1]))
    return rows


def parse_bool(text: str) -> bool:
    """true/false (also 1/0, yes/no, on/off) for a command-line option."""
    value = bool_word(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


class BenchFailed(RuntimeError):
    """A side's subprocess failed; the message names it and ends with its last stderr lines."""


# ---- arithmetic ---------------------------------------------------------------------------------

def flop_count(n_params: int, prompt_tokens_per_group: list[int], mean_completion_tokens: float, group_size: int,
               ppo_epochs: int, kl: bool) -> float:
    """FLOPs of one RL step at the 2·N FLOP-per-token forward / 4·N backward limit.

    Tokens per step T = Σ over the B groups of (P_g + G·R): each prompt is processed once per group
    (its KV cache shared by the G completions), each completion's R tokens once. Sampling costs 2·N·T,
    the reference pass (when kl) another 2·N·T, each PPO epoch of training 4·N·T (forward + backward
    w.r.t. activations; the frozen base needs no weight gradients). The behaviour-policy log-prob pass
    is not counted: it is avoidable (sampling can return those log-probs).
    """
    tokens = sum(prompt_tokens_per_group) + len(prompt_tokens_per_group) * group_size * mean_completion_tokens
    per_token = 2 + (2 if kl else 0) + 4 * ppo_epochs
    return per_token * n_params * tokens


def flop_limit_seconds(n_params: int, prompt_tokens_per_group: list[int], mean_completion_tokens: float,
                       group_size: int, ppo_epochs: int, kl: bool, flops_per_s: float) -> float:
    """Seconds one RL step would take at `flops_per_s` (the measured fp32 matmul rate): `flop_count` / rate."""
    return flop_count(n_params, prompt_tokens_per_group, mean_completion_tokens, group_size, ppo_epochs, kl) / flops_per_s


def drop_warmup(values: list[Any], warmup: int = 1) -> list[Any]:
    """The measured part of one process's per-step values: all but the first `warmup`."""
    return list(values[warmup:])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def split_steps(steps: int, rounds: int) -> list[int]:
    """Measured steps of each of `rounds` rounds, as even as possible, summing to `steps`."""
    if rounds < 1 or steps < 1 or rounds > steps:
        raise ConfigError(f"--alternate {rounds}: must be between 1 and --steps ({steps})")
    return [steps // rounds + (1 if k < steps % rounds else 0) for k in range(rounds)]


def matmul_rates(n: int = 2048, seconds: float = 2.0, probe: int = 256) -> tuple[dict[str, float], dict[str, int]]:
    """The machine's fp32 matmul rate (FLOP/s) per kernel, each timed on two n×n matrices for about
    `seconds` after one untimed warm-up, 2·n³ FLOP per product: "torch.mm" (PyTorch's default, MKL
    sgemm on x86), where this torch build has it "onednn_packed" (oneDNN with a pre-packed operand,
    what llmrl's frozen linears use on CPU where it pays), "torch.mm_bf16" (bf16 inputs) and
    "onednn_packed_bf16" (what llmrl's bf16 products use). The FLOP limit uses the fastest kernel of
    the precision llmrl runs in on this machine (`bf16_rate` / `fp32_rate`).

    A kernel whose one n×n product would take longer than `seconds` (judged from one probe×probe
    product) is timed on probe×probe matrices instead: bf16 on a CPU without bf16 instructions ran at
    0.16 GFLOP/s on 2048×2048 (two products: 3.5 minutes) and 1.9 on 256×256 (AMD EPYC Zen 1), so
    such a rate is not the full-size one; it matters only where llmrl runs bf16 on that CPU (forced
    `dtype`). Returns (FLOP/s, the n it was timed at) by kernel."""
    rates, sizes = {}, {}
    small = matmul_kernels(probe)
    for name, run in matmul_kernels(n).items():
        small[name]()  # warm-up
        t0 = time.perf_counter()
        small[name]()
        sizes[name] = timing_size(time.perf_counter() - t0, probe, n, seconds)
        rates[name] = time_kernel(run if sizes[name] == n else small[name], sizes[name], seconds)
    return rates, sizes


def timing_size(probe_s: float, probe: int, n: int, seconds: float) -> int:
    """n if one n×n product, projected from a probe×probe one that took probe_s (cubic in the size),
    fits in `seconds`; else probe."""
    return n if probe_s * (n / probe) ** 3 <= seconds else probe


def matmul_kernels(n: int) -> dict[str, Callable[[], Any]]:
    """`matmul_rates`' kernels on two random n×n matrices, by name."""
    import torch

    from llmrl.models.packed_linear import onednn_available, onednn_bf16_available, pack_weight, packed_matmul

    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    a16, b16 = a.bfloat16(), b.bfloat16()
    kernels = {"torch.mm": lambda: torch.mm(a, b, out=c)}
    if onednn_available():
        packed = pack_weight(b)
        kernels["onednn_packed"] = lambda: packed_matmul(a, packed, None)
    kernels["torch.mm_bf16"] = lambda: torch.mm(a16, b16)  # AMX / AVX512_BF16 where the CPU has them
    if onednn_bf16_available():
        packed16 = pack_weight(b16)
        kernels["onednn_packed_bf16"] = lambda: packed_matmul(a16, packed16, None)
    return kernels


def time_kernel(run: Callable[[], Any], n: int, seconds: float) -> float:
    """FLOP/s of `run` (an n×n by n×n product) over about `seconds` after one untimed call."""
    run()
    reps, t0 = 0, time.perf_counter()
    while True:
        run()
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2 * n**3 * reps / elapsed


def fp32_rate(rates: dict[str, float]) -> float:
    """The fastest fp32 kernel's rate among `matmul_rates`."""
    return max(v for k, v in rates.items() if not k.endswith("_bf16"))


def bf16_rate(rates: dict[str, float]) -> float:
    """The fastest bf16 kernel's rate among `matmul_rates`."""
    return max(v for k, v in rates.items() if k.endswith("_bf16"))


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def summarize(steps: list[dict[str, Any]], peak_mb: float, n_params: int, cfg: dict[str, Any],
              flops_per_s: float) -> dict[str, Any]:
    """A side's figures from its measured steps (dicts with step_s, rollout_s, update_s,
    completion_tokens, prompt_tokens; optional generate_s and logprobs_s, the parts of rollout_s spent
    generating and in the old and reference log-prob forwards)."""
    n = cfg["batch_size"] * cfg["group_size"]
    limits = [
        flop_limit_seconds(n_params, s["prompt_tokens"], s["completion_tokens"] / n, cfg["group_size"],
                           cfg["ppo_epochs"], cfg["kl_coef"] > 0, flops_per_s)
        for s in steps
    ]
    step_s = median([s["step_s"] for s in steps])
    limit_s = median(limits)
    out = {
        "step_s": step_s,
        "rollout_s": median([s["rollout_s"] for s in steps]),
        "update_s": median([s["update_s"] for s in steps]),
        "tokens_per_s": sum(s["completion_tokens"] for s in steps) / sum(s["step_s"] for s in steps),
        "peak_mb": peak_mb,
        "completion_tokens_per_step": statistics.mean(s["completion_tokens"] for s in steps),
        "mean_completion_tokens": statistics.mean(s["completion_tokens"] / n for s in steps),
        "prompt_tokens_per_step": statistics.mean(sum(s["prompt_tokens"]) for s in steps),
        "flop_limit_s": limit_s,
        "flop_limit_ratio": step_s / limit_s,
        "measured_steps": len(steps),
        "steps": steps,
    }
    for part in ("generate_s", "logprobs_s"):
        if any(s.get(part) is not None for s in steps):
            out[part] = median([s[part] for s in steps if s.get(part) is not None])
    return out


# ---- the llmrl side (child process) ---------------------------------------------------------------

def run_llmrl(values: dict[str, Any]) -> dict[str, Any]:
    """Train with llmrl (`values`: TrainConfig fields); per-step figures from its metrics.jsonl."""
    from llmrl.config import load_config
    from llmrl.rollout.prompts import prompt_length
    from llmrl.run_files import METRICS
    from llmrl.tasks import task_from_config
    from llmrl.training.loop import train

    cfg = load_config(None, values)
    result = train(cfg, overwrite=True)
    records = [json.loads(line) for line in (Path(cfg.output_dir) / METRICS).read_text().splitlines() if line.strip()]
    records = [r for r in records if "time/rollout_s" in r]
    # the prompts of each step: batch_size draws from the task's seeded RNG, as the loop draws them
    task = task_from_config(cfg)
    n = cfg.batch_size * cfg.group_size
    steps = []
    for r in records:
        prompts = [ex.messages for ex in task.sample_train_batch(cfg.batch_size)]
        prompt_tokens = [min(prompt_length(result.tokenizer, m), cfg.max_prompt_tokens) for m in prompts]
        steps.append({
            "step_s": r["time/rollout_s"] + r["time/update_s"], "rollout_s": r["time/rollout_s"],
            "update_s": r["time/update_s"], "completion_tokens": r["rollout/completion_len"] * n,
            "prompt_tokens": prompt_tokens, "generate_s": r.get("time/generate_s"), "logprobs_s": r.get("time/logprobs_s"),
        })
    n_params = sum(p.numel() for name, p in result.model.named_parameters() if "lora_" not in name)
    return {"side": "llmrl", "steps": steps, "n_params": n_params,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmrl.bench", description="One side of `llmrl bench` (internal).")
    parser.add_argument("--child", choices=["llmrl"], required=True)
    parser.add_argument("--config_json", required=True)
    args = parser.parse_args(argv)
    result = run_llmrl(json.loads(args.config_json))
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return 0


# ---- the parent -----------------------------------------------------------------------------------

# llmrl sides with another rollout engine: --rollout_engine vllm adds llmrl_vllm; vllm-server adds the
# server engine synchronous and async (one step ahead), whose last step is run but not counted: it has no
# next step to draw during its update, so it would be cheaper than every other async step
ENGINE_SIDES = {"llmrl_vllm": {"rollout_engine": "vllm"}, "llmrl_server": {"rollout_engine": "vllm-server"},
                "llmrl_server_async": {"rollout_engine": "vllm-server", "max_staleness": 1}}
SIDES_OF_ENGINE = {"hf": [], "vllm": ["llmrl_vllm"], "vllm-server": ["llmrl_server", "llmrl_server_async"]}


def run_side(side: str, values: dict[str, Any], out_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """Run one side for values["steps"] RL steps in a fresh subprocess; return its JSON figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    values = {**values, "output_dir": str(out_dir / "run")}
    if side == "trl_checkpointing":  # TRL as it ships: GRPOConfig's default gradient checkpointing on
        values["gradient_checkpointing"] = True
    values |= ENGINE_SIDES.get(side, {})  # llmrl with another rollout engine
    if side.startswith("llmrl"):
        cmd = [sys.executable, "-m", "llmrl.bench", "--child", "llmrl", "--config_json", json.dumps(values)]
    else:
        cmd = [sys.executable, "-m", "llmrl.bench_trl", "--config_json", json.dumps(values),
               "--output_dir", str(out_dir / "trl")]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
    t0 = time.perf_counter()
    with open(out_dir / "stderr.log", "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    (out_dir / "stdout.log").write_text(proc.stdout)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    try:
        if proc.returncode != 0:
            raise ValueError
        result = json.loads(lines[-1])
    except (ValueError, IndexError):
        tail = [line.strip() for line in (out_dir / "stderr.log").read_text(errors="replace").splitlines()
                if line.strip().strip("^~") and not line.startswith(" " * 8)][-3:]
        raise BenchFailed(f"the {side} side failed (exit {proc.returncode}; log {out_dir / 'stderr.log'}): "
                          + " | ".join(tail)) from None
    if not quiet:
        print(f"llmrl bench: {side} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return result


def bench_values(config: str | None, model: str | None) -> tuple[str, dict[str, Any]]:
    """(config name, validated TrainConfig fields as a dict) for --config/--model."""
    from llmrl.config import load_config, read_yaml

    base = read_yaml(config) if config else cpu_bench()
    if model:
        base["model"] = model
    cfg = load_config(None, base)
    return (Path(config).stem if config else "cpu-bench"), cfg.to_dict()


def child_values(values: dict[str, Any], steps: int, **changes: Any) -> dict[str, Any]:
    """A side's config: `steps` RL steps, no eval, no samples log, no wandb."""
    return {**values, **changes, "steps": steps, "eval_n": 0, "eval_interval": 0, "save_interval": 0,
            "sample_log_interval": 0, "wandb": False}


def run_bench(model: str | None = None, config: str | None = None, steps: int = 3, no_trl: bool = False,
              sweep: bool = False, alternate: int = 1, work_dir: str | None = None, warmup: int = 1,
              matmul_seconds: float = 2.0, num_threads: int | None = None,
              trl_checkpointing: bool = True, rollout_engine: str = "hf") -> dict[str, Any]:
    """Run the benchmark; return every figure as a JSON-ready dict. rollout_engine=vllm adds the side
    `llmrl_vllm` (llmrl with the vllm engine) beside llmrl with hf and TRL; vllm-server adds `llmrl_server`
    and `llmrl_server_async` (max_staleness 1)."""
    if steps < 1:
        raise ConfigError(f"--steps {steps}: must be at least 1")
    rounds = split_steps(steps, alternate)
    if not no_trl and importlib.util.find_spec("trl") is None:
        raise ConfigError(TRL_MISSING)
    if rollout_engine not in SIDES_OF_ENGINE:
        raise ConfigError(f"--rollout_engine {rollout_engine}: must be one of {', '.join(SIDES_OF_ENGINE)}")
    if rollout_engine != "hf" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"--rollout_engine {rollout_engine}: vLLM is not installed (make vllm on CPU, "
                          f"{pip_install('vllm')} on CUDA)")
    name, values = bench_values(config, model)
    if num_threads is not None:
        if num_threads < 0:
            raise ConfigError(f"--num_threads {num_threads}: must not be negative")
        values["num_threads"] = num_threads
    from llmrl.models.loading import resolve_model_path

    values["model"] = resolve_model_path(values["model"])  # children get a local directory
    if not no_trl:
        from llmrl.bench_trl import trl_settings

        try:
            trl_settings(values)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    own_dir = work_dir is None
    root = Path(tempfile.mkdtemp(prefix="llmrl-bench-")) if own_dir else Path(work_dir)
    done = False
    try:
        import torch

        if values["num_threads"]:
            torch.set_num_threads(values["num_threads"])  # the children use the same thread count
        rates, sizes = matmul_rates(seconds=matmul_seconds)
        from llmrl.models.loading import pick_device, pick_dtype

        dtype, bf16_matmul, precision = pick_dtype(values.get("dtype", "auto"), pick_device(values.get("device", "auto")))
        bf16 = bf16_matmul or dtype == torch.bfloat16
        flops = bf16_rate(rates) if bf16 else fp32_rate(rates)  # the FLOP limit: the rate of llmrl's precision here
        sides = ["llmrl", *SIDES_OF_ENGINE[rollout_engine]]
        sides += [] if no_trl else ["trl"] + (["trl_checkpointing"] if trl_checkpointing else [])
        measured: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        warm: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        peak: dict[str, float] = {s: 0.0 for s in sides}
        n_params: dict[str, int] = {}
        for k, n in enumerate(rounds, 1):
            for side in sides:
                print(f"llmrl bench: round {k}/{len(rounds)}: {side}, {warmup} warm-up + {n} measured steps",
                      file=sys.stderr, flush=True)
                last = int(side.endswith("_async"))  # run, not counted
                r = run_side(side, child_values(values, warmup + n + last), root / f"round{k}-{side}")
                if len(r["steps"]) < warmup + n + last:
                    raise BenchFailed(f"the {side} side reported {len(r['steps'])} steps, expected {warmup + n + last}")
                warm[side] += r["steps"][:warmup]
                measured[side] += drop_warmup(r["steps"][: warmup + n], warmup)
                peak[side] = max(peak[side], r["max_rss_mb"])
                n_params[side] = r["n_params"]
        result: dict[str, Any] = {
            "config": name, "model": values["model"], "steps": steps, "warmup_steps": warmup,
            "alternate": len(rounds), "matmul_gflops": flops / 1e9,
            "matmul_gflops_by_kernel": {k: v / 1e9 for k, v in rates.items()},
            "matmul_n_by_kernel": sizes,  # 2048, or 256 for a kernel too slow here to time at 2048
            "matmul": ("fastest bf16 kernel (llmrl runs bf16 here)" if bf16 else "fastest fp32 kernel (torch.mm, oneDNN packed)")
                      + ", 2048x2048, 2*n^3 FLOP each",
            "precision": precision,
            "num_threads": values["num_threads"] or torch_threads(),
            "n_params": n_params["llmrl"], "n_params_counts": N_PARAMS_NOTE,
            "settings": {k: values[k] for k in cpu_bench() if k in values and k not in ("output_dir", "steps")},
        }
        for side in sides:
            result[side] = summarize(measured[side], peak[side], n_params[side], values, flops)
            result[side]["warmup"] = warm[side]
        for side in (*ENGINE_SIDES, "trl", "trl_checkpointing"):
            result.setdefault(side, None)
        # like for like: TRL with llmrl's settings, gradient checkpointing off on both sides
        result["speedup_vs_trl"] = result["trl"]["step_s"] / result["llmrl"]["step_s"] if result["trl"] else None
        # TRL with its own default (gradient checkpointing on), as SPEC.md's 87 s figure was measured
        result["speedup_vs_trl_checkpointing"] = (
            result["trl_checkpointing"]["step_s"] / result["llmrl"]["step_s"] if result["trl_checkpointing"] else None)
        v = result["llmrl_vllm"]
        result["speedup_vllm_vs_trl"] = result["trl"]["step_s"] / v["step_s"] if v and result["trl"] else None
        from llmrl.bench_trl import definition_differences  # TRL itself is imported only in the TRL child

        result["trl_differences"] = [] if no_trl else definition_differences(values)  # printed under the table
        result["vllm_vs_hf_step_ratio"] = v["step_s"] / result["llmrl"]["step_s"] if v else None  # > 1: vllm slower
        a, b = result["llmrl_server"], result["llmrl_server_async"]
        result["async_vs_sync_step_ratio"] = b["step_s"] / a["step_s"] if a and b else None  # < 1: overlap pays
        result["flop_limit_ratio"] = result["llmrl"]["flop_limit_ratio"]
        # the same ratio against torch.mm's rate (how this figure was computed before oneDNN was measured)
        result["flop_limit_ratio_torch_mm"] = result["flop_limit_ratio"] * rates["torch.mm"] / flops
        # ... at the fastest fp32 rate, and at the bf16 rate
        result["flop_limit_ratio_fp32"] = result["flop_limit_ratio"] * fp32_rate(rates) / flops
        result["flop_limit_ratio_bf16"] = result["flop_limit_ratio"] * bf16_rate(rates) / flops
        result["flop_limit_s"] = result["llmrl"]["flop_limit_s"]
        rows = list(SWEEP) if sweep is True else list(sweep or [])
        result["sweep"] = run_sweep(values, steps, warmup, flops, result["llmrl"], root, rows) if rows else None
        done = True
        return result
    finally:
        if own_dir and done:  # after a failure the logs stay, for the error message's path
            shutil.rmtree(root, ignore_errors=True)


def run_sweep(values: dict[str, Any], steps: int, warmup: int, flops: float, base: dict[str, Any],
              root: Path, sweep: list[tuple[int, int | None, int]] = SWEEP) -> list[dict[str, Any]]:
    """llmrl only: seconds per step and per completion token as group size and max_new_tokens grow.
    The config's own row comes first and reuses the main measurement."""
    rows = []
    own = (values["group_size"], None, values["max_new_tokens"])
    for group, min_new, max_new in [own] + [r for r in sweep if r != own]:
        min_new = values["min_new_tokens"] if min_new is None else min_new
        if (group, min_new, max_new) == (values["group_size"], values["min_new_tokens"], values["max_new_tokens"]):
            s = base
        else:
            print(f"llmrl bench: sweep group_size {group}, new tokens {min_new}-{max_new}: {warmup} warm-up + {steps} "
                  "steps", file=sys.stderr, flush=True)
            v = child_values(values, warmup + steps, group_size=group, min_new_tokens=min_new, max_new_tokens=max_new)
            r = run_side("llmrl", v, root / f"sweep-g{group}-m{min_new}-{max_new}")
            s = summarize(drop_warmup(r["steps"], warmup), r["max_rss_mb"], r["n_params"], v, flops)
        per_token = median([x["step_s"] / x["completion_tokens"] for x in s["steps"]])
        rows.append({"group_size": group, "min_new_tokens": min_new, "max_new_tokens": max_new, "step_s": s["step_s"],
                     "tokens_per_s": s["tokens_per_s"], "completion_tokens_per_step": s["completion_tokens_per_step"],
                     "s_per_completion_token": per_token, "flop_limit_ratio": s["flop_limit_ratio"],
                     "peak_mb": s["peak_mb"], "rollout_s": s["rollout_s"], "generate_s": s.get("generate_s"),
                     "logprobs_s": s.get("logprobs_s"), "update_s": s["update_s"]})
    return rows


def seconds_cell(value: float | None) -> str:
    """A table cell of 8 characters: seconds to 2 decimals, or "-" where a side did not measure them."""
    return f"{value:8.2f}" if value is not None else f"{'-':>8}"


def kernel_rate(r: dict[str, Any], kernel: str) -> str:
    """'torch.mm 69', or 'torch.mm_bf16 1.9 on 256x256' for a kernel timed on the small probe."""
    rate, n = r["matmul_gflops_by_kernel"][kernel], r.get("matmul_n_by_kernel", {}).get(kernel, 2048)
    return f"{kernel} {rate:.0f}" if n == 2048 else f"{kernel} {rate:.2g} on {n}x{n}"


def format_report(r: dict[str, Any]) -> str:
    per = "per process" if r["alternate"] > 1 else ""
    rounds = f", {r['alternate']} alternating rounds" if r["alternate"] > 1 else ""
    lines = [f"llmrl bench: {r['config']}, {r['steps']} measured steps per side after {r['warmup_steps']} warm-up"
             f"{(' ' + per) if per else ''}{rounds}, {r['num_threads']} threads, matmul {r['matmul_gflops']:.1f} GFLOP/s"
             f" ({', '.join(kernel_rate(r, k) for k in r['matmul_gflops_by_kernel'])})",
             f"{'side':<19} {'s/step':>8} {'rollout':>8} {'generate':>8} {'update':>8} {'tok/s':>8} {'peak MB':>8}"]
    for side in ("llmrl", *ENGINE_SIDES, "trl", "trl_checkpointing"):
        s = r.get(side)
        if s:
            lines.append(f"{side:<19} {s['step_s']:8.2f} {s['rollout_s']:8.2f} {seconds_cell(s.get('generate_s'))} "
                         f"{s['update_s']:8.2f} {s['tokens_per_s']:8.1f} {s['peak_mb']:8.0f}")
    speed = f"{r['speedup_vs_trl']:.1f}x" if r["speedup_vs_trl"] is not None else "n/a (--no_trl)"
    if r.get("speedup_vs_trl_checkpointing") is not None:
        speed += f" (trl_checkpointing: TRL's default gradient checkpointing on: {r['speedup_vs_trl_checkpointing']:.1f}x)"
    lines.append(f"speedup_vs_trl {speed}   flop_limit_ratio {r['flop_limit_ratio']:.1f} "
                 f"(limit {r['flop_limit_s']:.2f} s/step at the {'bf16' if 'bf16' in r['matmul'] else 'fp32'} rate; "
                 f"{r['flop_limit_ratio_fp32']:.1f} at the fp32 rate, {r['flop_limit_ratio_bf16']:.1f} at the bf16 rate, "
                 f"{r['flop_limit_ratio_torch_mm']:.1f} at torch.mm's)")
    lines += [f"differs from TRL: {line}" for line in r.get("trl_differences") or []]
    if r.get("llmrl_vllm"):
        trl = f", {r['speedup_vllm_vs_trl']:.1f}x TRL" if r.get("speedup_vllm_vs_trl") else ""
        lines.append(f"llmrl_vllm: {r['vllm_vs_hf_step_ratio']:.2f}x llmrl (hf)'s s/step{trl}")
    if r.get("async_vs_sync_step_ratio") is not None:
        lines.append(f"llmrl_server_async (max_staleness 1): {r['async_vs_sync_step_ratio']:.2f}x llmrl_server's s/step "
                     "(< 1: drawing step s+1 during step s's update pays)")
    s = r["llmrl"]
    lines.append(f"(limit: N={r['n_params'] / 1e6:.1f}M params, {r['n_params_counts']}; "
                 f"P={s['prompt_tokens_per_step']:.0f} prompt tokens/step, R={s['mean_completion_tokens']:.1f} "
                 f"tokens/completion)")
    if r.get("sweep"):
        lines.append("sweep (llmrl): cost as group size and max_new_tokens grow")
        lines.append(f"{'group':>5} {'new tokens':>10} {'s/step':>8} {'generate':>8} {'tok/step':>9} {'ms/token':>9} "
                     f"{'flop_ratio':>10} {'peak MB':>8}")
        for row in r["sweep"]:
            lines.append(f"{row['group_size']:>5} {str(row['min_new_tokens']) + '-' + str(row['max_new_tokens']):>10} "
                         f"{row['step_s']:8.2f} {seconds_cell(row.get('generate_s'))} "
                         f"{row['completion_tokens_per_step']:9.0f} "
                         f"{1000 * row['s_per_completion_token']:9.1f} {row['flop_limit_ratio']:10.1f} {row['peak_mb']:8.0f}")
    return "\n".join(lines)


# ---- CLI glue -------------------------------------------------------------------------------------

def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to an argparse subparsers object (its parser_class is used)."""
    p = sub.add_parser(
        "bench", help="time llmrl against TRL's GRPOTrainer on cpu-bench",
        description="Run the cpu-bench config with llmrl and with TRL's GRPOTrainer (same model, prompts and "
                    "settings), each side in its own process, and report seconds per RL step, tokens/s, peak "
                    "memory, the speed ratio and llmrl's step time over the FLOP limit at the measured matmul rate.",
    )
    p.add_argument("--steps", type=int, default=3, help="measured RL steps per side, after 1 warm-up step per process (default: 3)")
    p.add_argument("--no_trl", action="store_true", help="skip TRL (speedup_vs_trl is then null)")
    p.add_argument("--trl_checkpointing", type=parse_bool, default=True, metavar="BOOL",
                   help="also run TRL with its default gradient checkpointing on (the other TRL side has it off, like llmrl) (default: true)")
    p.add_argument("--sweep", nargs="?", const="all", type=sweep_rows, metavar="ROWS",
                   help="also time llmrl at group size 4, 8, 16 (max_new_tokens 24), max_new_tokens 64, 128 (group size 4), "
                        "and forced lengths min_new_tokens = max_new_tokens = 128, 512 (group size 4); or only ROWS, "
                        "comma-separated G:MAX or G:MIN:MAX (e.g. 4:512:512), beside the config's own row")
    p.add_argument("--model", help="model to benchmark (default: the config's, smollm2-135m-instruct)")
    p.add_argument("--config", help="YAML file of config fields (default: the built-in cpu-bench config)")
    p.add_argument("--alternate", type=int, default=1, metavar="K",
                   help="interleave the sides in K rounds of steps/K measured steps each, llmrl then TRL, each in a fresh process (default: 1)")
    p.add_argument("--work_dir", help="directory for the sides' run outputs and logs (default: a temporary directory, removed)")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    p.add_argument("--num_threads", type=int, metavar="N",
                   help="torch CPU threads for both sides and the matmul probe (default: the config's; 0 = torch's default)")
    p.add_argument("--matmul_seconds", type=float, default=2.0, help="how long to measure the fp32 matmul rate (default: 2)")
    p.add_argument("--rollout_engine", default="hf", choices=list(SIDES_OF_ENGINE),
                   help="vllm: also time llmrl with its vllm rollout engine (side llmrl_vllm); vllm-server: with the server "
                        "engine, synchronous (llmrl_server) and async, max_staleness 1 (llmrl_server_async) (default: hf)")
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        result = run_bench(model=args.model, config=args.config, steps=args.steps, no_trl=args.no_trl, sweep=args.sweep,
                           alternate=args.alternate, work_dir=args.work_dir, matmul_seconds=args.matmul_seconds,
                           num_threads=args.num_threads, trl_checkpointing=args.trl_checkpointing,
                           rollout_engine=args.rollout_engine)
    except BenchFailed as e:
        print(f"llmrl: error: bench: {e}", file=sys.stderr)
        return 1
    print(format_report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, allow_nan=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`llmrl bench` on its own (until the CLI dispatches it): python -m llmrl.bench [options]."""
    from llmrl.errors import UserError

    parser = argparse.ArgumentParser(prog="llmrl")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_bench(args)
    except UserError as e:
        print(f"llmrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.exit(child_main())
    sys.exit(main())
