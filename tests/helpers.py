"""Shared helpers for the tests that run the real CLI on the tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TESTS = Path(__file__).parent
TRAIN_KEYS = {
    "step", "reward/mean", "reward/distinct", "train/kl", "train/loss", "train/clip_frac", "train/entropy",
    "train/grad_norm", "train/optimizer_steps", "rollout/completion_len", "rollout/truncated_frac",
    "rollout/zero_spread_frac", "time/rollout_s", "time/generate_s", "time/logprobs_s", "time/update_s", "adv/mean", "adv/std",
}


def run_cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """Run `llmrl ARGS` (or, with `fault`, tests/faults.py FAULT ARGS) and return the finished process."""
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    prefix = [str(TESTS / "faults.py"), fault] if fault else ["-m", "llmrl"]
    return subprocess.run([sys.executable, *prefix, *args], capture_output=True, text=True, timeout=600, env=env)


def cli(*args: str) -> subprocess.CompletedProcess:
    """Run `llmrl ARGS` and require success."""
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def tiny_args(model: str, out: Path, algo: str, steps: int = 2, **extra) -> list[str]:
    """`train` arguments for a few fast steps on the tiny model; `extra` adds or replaces options."""
    args = [
        "train", "--model", model, "--task", "toy_task:CharTask", "--algo", algo, "--steps", str(steps),
        "--batch_size", "2", "--group_size", "3", "--minibatch_size", "3", "--grad_accum_steps", "1",
        "--ppo_epochs", "2" if algo == "grpo" else "1", "--max_new_tokens", "6", "--max_prompt_tokens", "64",
        "--lr", "1e-2", "--warmup_steps", "0", "--lora_r", "4", "--lora_alpha", "8", "--gradient_checkpointing", "false",
        "--eval_interval", "1", "--eval_n", "2", "--save_interval", "1", "--sample_log_interval", "1",
        "--output_dir", str(out), "--num_threads", "1",
    ]
    for key, value in extra.items():
        flag = f"--{key}"
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    return args


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def lora_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "adapter_model.safetensors")


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def assert_same_run(expected: Path, actual: Path, step: int) -> None:
    """Adapter weights at `step` within 1e-6, and every metric record (steps once each, same values
    apart from timings) as in the uninterrupted run."""
    ckpt = f"checkpoints/step_{step:06d}"
    a, b = lora_tensors(expected / ckpt), lora_tensors(actual / ckpt)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    ra, rb = read_jsonl(expected / "metrics.jsonl"), read_jsonl(actual / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            if k.startswith("time/") or x[k] is None:
                continue
            if isinstance(x[k], (int, float)):
                assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k, x[k], y[k])
            else:
                assert x[k] == y[k], (x["step"], k, x[k], y[k])  # e.g. the same health warnings


def kept_logits(logits: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """What a transformers causal LM returns for `logits_to_keep`: the last that many positions (an
    int; 0 keeps all), or the positions a 1-D tensor lists. For the hand-checkable fake models."""
    if torch.is_tensor(logits_to_keep):
        return logits[:, logits_to_keep]
    return logits[:, -logits_to_keep:] if logits_to_keep else logits


def stop_after(n: int, eos: int, spread: int = 0):
    """A KeyedSampler that ends every reply with EOS at its n-th token (the random tiny model never
    chooses EOS), or with `spread` at its (n + key % (spread + 1))-th, so rows of a batch end at
    different lengths; the other tokens are the keyed draw. Log-probs are of the raw logits either way."""
    from llmrl.rollout.keyed import KeyedSampler

    class Stopping(KeyedSampler):
        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            t = input_ids.shape[1] - self.prompt_width
            for row, key in enumerate(self.row_keys):
                if t == n - 1 + key % (spread + 1):
                    out[row] = float("-inf")
                    out[row, eos] = 0.0
            return out

    return Stopping


def plain_greedy(model_dir: Path, n: int = 4, max_new_tokens: int = 6) -> list[str]:
    """Greedy completions of toy_task's first n eval prompts by a model directory loaded with plain transformers."""
    from toy_task import CharTask
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    got = []
    for ex in CharTask().eval_examples(n):
        text = tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        got.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return got
