"""Using a trained adapter outside llmrl: `llmrl export` (a portable adapter, or a merged full model in
Hugging Face format, each with a filled model card) and `llmrl chat` (a few turns in the terminal).

    llmrl export runs/quickstart --out exported/            adapter + adapter_config.json + README.md
    llmrl export runs/quickstart --out merged/ --merge      model.safetensors + config + tokenizer + README.md
    llmrl export runs/quickstart-full --out model/          the same for a full-weight run (no --merge needed)
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

from llmrl.config import PRECISION_FILE, TRAINED_DTYPE, evaluation, exported_dtype
from llmrl.errors import ConfigError
from llmrl.model_card import model_card
from llmrl.run_files import CONFIG


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint directory, its run directory) for a run directory or one of its checkpoints."""
    from llmrl.checkpoint import latest_checkpoint

    from llmrl.checkpoint import is_full_checkpoint

    path = Path(path)
    if (path / "adapter_config.json").is_file() or is_full_checkpoint(path):
        return path, path.resolve().parent.parent
    if (path / CONFIG).is_file():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise ConfigError(f"{path}: no complete checkpoint under {path / 'checkpoints'}")
        return checkpoint, path
    raise ConfigError(f"{path}: neither a run directory (with {CONFIG}) nor a checkpoint (with adapter_config.json, or "
                      "model.safetensors for full weights)")


def load_run_config(run_dir: Path, overrides: dict[str, Any] | None = None):
    from llmrl.config import load_config

    if not (run_dir / CONFIG).is_file():
        raise ConfigError(f"{run_dir}: no {CONFIG} (export and chat need the run the checkpoint came from)")
    return load_config(run_dir / CONFIG, overrides or {})


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export(path: Path, out: Path, merge: bool = False, dtype: str = "float32", check: int = 4, task: str | None = None,
           trust_task_code: bool = False) -> Path:
    """Write a portable adapter (or, with `merge`, a full model) of a run or checkpoint to `out`.

    The merge is W + s·B·A in fp32 whatever precision the run trained in (merging into bf16 weights
    rounds away small adapter deltas), then cast to `dtype`; llmrl.json records the precision the merged
    weights are evaluated in (config.precision_rule: `llmrl eval --base --model OUT` then computes what
    `llmrl eval --run` computes). Afterwards the saved model is loaded back and its greedy completions of
    `check` eval prompts compared with the trained policy's, as llmrl evaluates it (printed; with dtype
    bfloat16/float16 the cast itself may change some). The check's prompts come from `task` (default: the
    run's; task code the run names is imported only with `trust_task_code`: tasks.check_task_code)."""
    from llmrl.tasks import check_task_code

    checkpoint, run_dir = find_checkpoint(path)
    cfg = load_run_config(run_dir)
    merge = merge or cfg.finetune == "full"  # full weights are a whole model already: exported as one
    prompts_cfg = load_run_config(run_dir, {"task": task}) if task else cfg  # the card keeps the run's task
    if merge and check > 0:
        check_task_code(prompts_cfg, run_dir, trust_task_code or bool(task))
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype}: must be one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty")
    out.mkdir(parents=True, exist_ok=True)
    if merge:
        import torch

        model, tokenizer, _, precision = load_policy(cfg, checkpoint)
        print(f"llmrl: {precision}", file=sys.stderr, flush=True)
        merged = model if cfg.finetune == "full" else model.merge_and_unload()  # the weights `eval --run` evaluates
        prompts = check_prompts(prompts_cfg, check)
        before = greedy_texts(merged, tokenizer, prompts, cfg.max_new_tokens)
        merged = merged.to(getattr(torch, dtype))
        merged.save_pretrained(out)
        tokenizer.save_pretrained(out)
        evaluated = exported_dtype(dtype)
        (out / PRECISION_FILE).write_text(json.dumps({"dtype": evaluated}) + "\n")
        if prompts:
            from transformers import AutoModelForCausalLM

            reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, evaluated), use_safetensors=True,
                                                            trust_remote_code=False).to(merged.device)
            after = greedy_texts(reloaded, tokenizer, prompts, cfg.max_new_tokens)
            same = sum(a == b for a, b in zip(before, after))
            print(f"llmrl export: greedy check: {same}/{len(prompts)} eval prompts give the trained policy's "
                  f"completion ({dtype} weights, evaluated in {evaluated})", file=sys.stderr)
    else:
        shutil.copy(checkpoint / "adapter_model.safetensors", out / "adapter_model.safetensors")
        config = json.loads((checkpoint / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = cfg.model  # as the user named it, not this machine's cache path
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    state = checkpoint / "trainer_state.json"
    step = json.loads(state.read_text())["step"] if state.is_file() else "?"
    (out / "README.md").write_text(model_card(cfg, step, run_dir, merge), encoding="utf-8")
    mode = (out / "README.md").stat().st_mode & 0o777  # 0666 less the umask, as open() made it
    for weights in out.glob("*.safetensors"):  # safetensors writes 0600 files (and copy keeps the checkpoint's)
        weights.chmod(mode)
    return out


def check_prompts(cfg, n: int) -> list[list[dict[str, str]]]:
    """Up to n of the task's eval prompts (none when the task's data is not available here)."""
    from llmrl.tasks import task_from_config

    try:
        return [ex.messages for ex in task_from_config(cfg).eval_examples(n)] if n > 0 else []
    except Exception:  # noqa: BLE001 - no data for the task on this machine: no check
        return []


def greedy_texts(model, tokenizer, prompts: list[list[dict[str, str]]], max_new_tokens: int) -> list[str]:
    """Plain transformers greedy completions, one prompt at a time (no padding effects)."""
    import torch

    texts = []
    with torch.no_grad():
        for messages in prompts:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            texts.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return texts


def load_policy(cfg, checkpoint: Path):
    """(policy with the checkpoint's adapter or full weights, tokenizer, its plan, precision line) on the config's
    device, in the precision of trained weights (config.precision_rule), plain kernels."""
    from llmrl.checkpoint import load_policy_weights
    from llmrl.training.run import build_policy

    cfg, plan, precision = evaluation(cfg, None, TRAINED_DTYPE)
    plan = dataclasses.replace(plan, onednn_linear=False, hash_dropout=False, fuse_lora=False)  # plain linears:
    model, tokenizer, _ = build_policy(cfg, plan)  # mergeable, exportable
    load_policy_weights(checkpoint, model)
    return model.eval(), tokenizer, plan, precision


def chat(path: Path, task: str | None = None, max_new_tokens: int = 256, lines=None, write=print,
         trust_task_code: bool = False) -> int:
    """Read user messages (one per line, from `lines` or stdin) and print the policy's greedy replies,
    with the task's system prompt when it has one. Each turn is a fresh conversation. Task code the run
    names is imported only with `trust_task_code` or `task` (tasks.check_task_code)."""
    from llmrl.rollout import make_engine
    from llmrl.rollout.base import Sampling
    from llmrl.rollout.episodes import one_turn
    from llmrl.tasks import check_task_code, task_from_config

    checkpoint, run_dir = find_checkpoint(path)
    cfg = load_run_config(run_dir, {"task": task} if task else {})
    check_task_code(cfg, run_dir, trust_task_code or bool(task))
    model, tokenizer, plan, precision = load_policy(cfg, checkpoint)
    print(f"llmrl: {precision}", file=sys.stderr, flush=True)
    system = None
    try:
        example = task_from_config(cfg).eval_examples(1)[0]
        system = next((m["content"] for m in example.messages if m["role"] == "system"), None)
    except Exception:  # noqa: BLE001 - no data for the task here: chat without its system prompt
        pass
    engine = make_engine(cfg, plan, tokenizer)
    engine.load(model, 0)
    sampling = Sampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, min_new_tokens=0,
                        max_new_tokens=max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens)  # greedy replies
    write(f"llmrl chat: {checkpoint} ({cfg.task}); one message per line, Ctrl-D to quit")
    for line in (lines if lines is not None else sys.stdin):
        text = line.strip()
        if not text:
            continue
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        write(one_turn(engine, tokenizer, [messages], group_size=1, seed=0, sampling=sampling, greedy=True).texts[0])
    return 0


def add_export_parsers(sub) -> None:
    from llmrl.cli import TRUST_HELP

    ex = sub.add_parser("export", help="write a portable adapter or a merged model with a model card",
                        description="Export a run's newest checkpoint (or a given checkpoint) for use outside llmrl.")
    ex.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    ex.add_argument("--out", required=True, metavar="DIR", help="an empty or new directory")
    ex.add_argument("--merge", action="store_true",
                    help="merge the adapter into the base weights: a full Hugging Face model (AutoModelForCausalLM)")
    ex.add_argument("--dtype", default="float32", choices=EXPORT_DTYPES,
                    help="weights of the merged model (merged in fp32 first; bf16/fp16 round W + ΔW and may lose small deltas)")
    ex.add_argument("--task", help="the task whose eval prompts check the merge (default: the run's)")
    ex.add_argument("--trust_task_code", action="store_true", help=TRUST_HELP)
    ch = sub.add_parser("chat", help="talk to a trained policy in the terminal",
                        description="Greedy replies of a run's policy, with its task's system prompt.")
    ch.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    ch.add_argument("--task", help="use this task's system prompt instead of the run's")
    ch.add_argument("--trust_task_code", action="store_true", help=TRUST_HELP)
    ch.add_argument("--max_new_tokens", type=int, default=256)


def cmd_export(args: argparse.Namespace) -> int:
    out = export(Path(args.path), Path(args.out), merge=args.merge, dtype=args.dtype, task=args.task,
                 trust_task_code=args.trust_task_code)
    kind = "model" if (out / "config.json").is_file() else "adapter"
    print(f"llmrl export: {'merged model' if args.merge else kind} written to {out}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    return chat(Path(args.path), task=args.task, max_new_tokens=args.max_new_tokens,
                trust_task_code=args.trust_task_code)
