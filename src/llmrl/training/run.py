"""Setting up a run and what it does between steps: the run directory, resume, the policy and its
optimizer, loggers, signals; saving checkpoints and evaluating.

Everything the next step needs lives in the model, the optimizer, the task's RNG and the shuffle
generator (the learning rate is a function of the step), which is exactly what a checkpoint holds,
so `--resume` continues the run. A checkpoint holds the run's config too, and config.yaml is rewritten
with every checkpoint (and when a new run starts): on resume the two must agree key for key
(config.check_resume_config)."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from llmrl.chat_templates import use_chat_template
from llmrl.checkpoint import (checkpoint_tmp, disk_full, free_space_problem, latest_checkpoint, load_checkpoint,
                              load_policy_weights, remove_stale_temporaries, save_checkpoint, space_needed)
from llmrl.config import TRAINED_DTYPE, Plan, TrainConfig, precision_rule, resolve, resume_differences, save_config
from llmrl.errors import ConfigError, RunStopped
from llmrl.logger import RunLogger, check_log_sizes, plain
from llmrl.model_card import model_card
from llmrl.models.full import prepare_full
from llmrl.models.lora import fuse_lora_outputs
from llmrl.models.loading import (add_lora, contiguous_lm_head_input, grouped_query_attention, load_base_model,
                                  pick_device, run_in_bf16_autocast)
from llmrl.models.packed_linear import (
    available_memory_bytes,
    install_packed_linears,
    onednn_available,
    onednn_bf16_available,
    packable_linears,
    packing_pays_for,
)
from llmrl.rollout import RolloutEngine, Sampling, make_engine
from llmrl.rollout.episodes import EpisodeRunner, episode_runner
from llmrl.rollout.keyed import mix
from llmrl.rollout.prompts import eos_ids
from llmrl.run_files import CONFIG, DATA_REPORT, LOCK, REPORT, RUN_FILES, write_atomically
from llmrl.tasks import Task, is_environment, resume_command, task_from_config
from llmrl.tasks.dataset import check_train_rows
from llmrl.threads import start_threads
from llmrl.tasks.env import OneTurn
from llmrl.training import hooks
from llmrl.training.cpu_speed import keep_heap_memory, return_heap_memory, use_hash_dropout
from llmrl.training.distributed import Dist, init_distributed
from llmrl.training.evaluate import evaluate
from llmrl.dcp_files import failure_line
from llmrl.training.fsdp import full_state, gathered, save_sharded
from llmrl.training.health import Health
from llmrl.training.rollouts import RolloutSource
from llmrl.training.update import UpdateSettings


@dataclass
class Totals:
    """Counts over the whole run, saved with every checkpoint."""

    optimizer_steps: int = 0
    skipped_updates: int = 0  # non-finite optimizer windows and empty minibatches
    empty_minibatches: int = 0
    bad_in_a_row: int = 0  # non-finite optimizer windows since the last step taken
    reward_errors: int = 0
    prompts_skipped: int = 0
    completions: int = 0
    train_seconds: float = 0.0


@dataclass
class Run:
    """One training run: its config and plan, the policy, the task, and the state a checkpoint saves."""

    cfg: TrainConfig
    plan: Plan
    dir: Path
    dist: Dist
    model: Any  # the policy: LoRA-wrapped (PeftModel), or the transformers model itself (finetune full)
    tokenizer: Any
    task: Task
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    shuffle: torch.Generator  # minibatch order
    logger: RunLogger
    start: int  # the first step to run (1, or the step after the resumed checkpoint)
    resumed_from: Path | None
    config_notes: list[str] = field(default_factory=list)  # how this machine runs the config (config.yaml comments)
    lock: RunLock | None = None  # held by rank 0 until train() returns
    totals: Totals = field(default_factory=Totals)
    health: Health = field(default_factory=Health)
    episodes: EpisodeRunner | None = None  # how the task's episodes run (a single-turn task: one-turn episodes)
    learned: int = 0  # the last step learned (start - 1 until the first)
    update: UpdateSettings | None = None  # how a rollout updates the policy (built once, by build_run)
    rollouts: RolloutSource | None = None  # where each step's rollouts come from (sync, or one step ahead); it keeps
    #   the task's state from before every drawn, unlearned step's prompts: a checkpoint saves the oldest

    @property
    def eval_n(self) -> int:
        return eval_count(self.cfg, self.task)


def build_policy(cfg: TrainConfig, plan: Plan):
    """(policy, tokenizer, kernel choice) for a config: the LoRA-wrapped base (LoRA init seeded by cfg.seed), or
    with finetune full the base itself, every weight trainable (models/full.py).
    The kernel choice is one line saying how the frozen linears run (recorded in the run's config)."""
    base, tokenizer = load_base_model(cfg.model, plan.device, plan.dtype)
    use_chat_template(tokenizer, cfg.chat_template)  # --chat_template: for every prompt the run renders
    torch.manual_seed(cfg.seed)
    if plan.full:  # every weight trains: no adapter, no packed or bf16 copies of weights that change
        model = prepare_full(base, plan.gradient_checkpointing, reference=plan.with_ref and not plan.fsdp,  # FSDP2: a
                             autocast=plan.autocast)  # sharded copy instead (shard_sharded_run)
        contiguous_lm_head_input(model)
        if plan.grouped_attention:
            grouped_query_attention(model)
        return model, tokenizer, f"linears: F.linear{' under bf16 autocast' if plan.autocast else ''} (finetune full)"
    model = add_lora(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules, plan.gradient_checkpointing)
    if plan.hash_dropout:
        use_hash_dropout(model)  # same distribution, a vectorised mask
    if plan.fuse_lora:
        fuse_lora_outputs(model)  # base + s·(A x) Bᵀ in one addmm
    contiguous_lm_head_input(model)
    if plan.grouped_attention:
        grouped_query_attention(model)  # no repeat_kv copies in training and scoring forwards
    if plan.device.type == "cpu" and plan.dtype == torch.bfloat16:
        run_in_bf16_autocast(model)
    choice = "frozen linears: F.linear"
    free = available_memory_bytes()  # packs copy the frozen weights: only where that fits easily
    budget = None if free is None else free // 2
    if plan.bf16_matmul:
        packed = "oneDNN-packed " if onednn_bf16_available() else ""
        choice = (f"frozen linears: {packed}bf16 copies (fp32 in and out)" if install_packed_linears(model, budget, bf16=True)
                  else "frozen linears: F.linear in fp32 (not enough free memory for bf16 copies of the weights)")
    elif plan.onednn_linear and onednn_available() and packable_linears(model):
        pays, choice = (packing_pays_for(model) if plan.measure_kernels  # measured once per machine (kernels.json)
                        else (True, "frozen linears: oneDNN packed (onednn_linear=true)"))
        if pays and not install_packed_linears(model, budget):
            choice = "frozen linears: F.linear (not enough free memory for oneDNN packed weights)"
    return model, tokenizer, choice


class RunLock:
    """An exclusive flock on output_dir/.lock, with the holder's pid inside, held while a trainer writes the
    run: a second trainer on the same directory stops before reading or changing anything there. The kernel
    drops the lock when its process ends, however it ends, so a dead holder's file never blocks."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.fd = run_dir, None

    def take(self) -> None:
        """Hold the lock (once; making output_dir if needed), or raise ConfigError naming the holder's pid."""
        if self.fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"output_dir {self.run_dir} is not writable: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"output_dir {self.run_dir} is in use by another llmrl trainer (pid {holder}, "
                              f"{self.run_dir / LOCK}): wait for it to end or stop it, or use another "
                              "--output_dir") from None
        except OSError as e:  # a filesystem without flock (some network mounts): run unguarded, and say so
            print(f"llmrl: warning: cannot lock {self.run_dir / LOCK} ({e.strerror or e}); make sure no other "
                  "trainer writes this run", file=sys.stderr)
        self.fd = fd
        pid = f"{os.getpid()}\n".encode()
        try:
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        except OSError as e:
            self.release()
            raise ConfigError(f"output_dir {self.run_dir} is not writable: {e.strerror or e}") from None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to mix a new run into an old one, check the directory is writable, clear dead temporaries."""
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing and not resume:
        if not overwrite:
            raise ConfigError(f"output_dir {run_dir} already holds a run ({', '.join(existing)}): "
                              f"use --resume {run_dir}, --overwrite, or another --output_dir")
        for name in existing:
            shutil.rmtree(run_dir / name) if (run_dir / name).is_dir() else (run_dir / name).unlink()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir {run_dir} is not writable: {e.strerror or e}") from None
    remove_stale_temporaries(run_dir)


def find_resume_checkpoint(cfg: TrainConfig, run_dir: Path) -> Path:
    """The newest good checkpoint of `run_dir`, after checking `cfg` may continue it."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'} (it stopped "
                          "before its first save, which is all it would lose): start it again with --overwrite")
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["config"]
    differ = resume_differences(saved, cfg)
    if differ:
        raise ConfigError(f"--resume {run_dir}: config differs from {checkpoint.name}: {', '.join(differ)}")
    return checkpoint


def task_state_problem(state: Any) -> str | None:
    """None if a checkpoint can store the task's state_dict() (JSON, in trainer_state.json); else what is wrong,
    naming the key."""
    if not isinstance(state, dict):
        return f"state_dict() returned a {type(state).__name__}, not a dict"
    for key, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            return f"state_dict()[{key!r}] cannot be saved as JSON ({e})"
    return None


def rank_rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG streams that differ between ranks: the CPU generator and, on CUDA, the
    generator of this rank's own GPU (torch.cuda.current_device(), set from LOCAL_RANK). Rank 0's
    `rng.pt` entry `cuda_<i>` holds only what rank 0's process drew on GPU i, not rank i's stream."""
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return out


def restore_rank_rng(state: dict[str, Any], cfg: TrainConfig, dist: Dist) -> None:
    """Give each rank its own saved RNG stream back; if the checkpoint came from another world size,
    ranks without a saved stream start a fresh one (only LoRA dropout draws from it)."""
    if not dist.enabled:
        return
    saved = state.get("rank_rng", {}).get(f"torch_rank{dist.rank}")
    if saved is not None and state.get("world_size") == dist.world:
        torch.set_rng_state(saved)
        cuda = state["rank_rng"].get(f"cuda_rank{dist.rank}")  # this rank's own GPU stream (CUDA LoRA dropout)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
        return
    torch.manual_seed(mix(cfg.seed, 1 + dist.rank, state["step"]))  # seeds this process's CUDA devices too
    if dist.is_main:
        print(f"llmrl: resuming a {state.get('world_size', 1)}-process checkpoint on {dist.world} processes: same "
              "prompts, completions and updates; per-rank dropout RNG streams restart", file=sys.stderr)


def setup_run(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, start_lines: list[str] = ()) -> Run:
    """Everything before step 1 (or the resumed step): process group, run directory (locked by rank 0 until
    train() returns), task, policy, optimizer, checkpoint state, loggers."""
    dist = init_distributed(cfg.device, cfg.dist_timeout)
    lock = RunLock(Path(cfg.output_dir)) if dist.is_main else None
    try:
        return build_run(cfg, dist, lock, resume, overwrite, start_lines)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def build_run(cfg: TrainConfig, dist: Dist, lock: RunLock | None, resume: bool, overwrite: bool,
              start_lines: list[str] = ()) -> Run:
    """setup_run after the process group; `start_lines` (train's) printed once the task's data has loaded."""
    # before resolve: the kernel verdicts it reads are kept per thread count
    threads = start_threads(cfg.num_threads, on_cpu=pick_device(cfg.device).type == "cpu")
    plan = resolve(cfg)
    if plan.keep_heap_memory:
        keep_heap_memory()
    elif plan.return_heap_memory:
        return_heap_memory()
    run_dir = Path(cfg.output_dir)
    if lock is not None and run_dir.is_dir():
        lock.take()  # another trainer may be writing there: stop before reading or changing anything
    checkpoint = find_resume_checkpoint(cfg, run_dir) if resume else None
    task = task_from_config(cfg)  # before the run dir and the model: a bad task or data fails fast, leaving nothing
    check_train_rows(task, cfg.batch_size)
    if dist.is_main and start_lines:
        print("\n".join(start_lines), file=sys.stderr, flush=True)
    problem = task_state_problem(task.state_dict())
    if problem:
        raise ConfigError(f"task {cfg.task}: {problem}; a checkpoint saves the task's state as JSON: return numbers, "
                          "strings, lists and dicts of them")
    if lock is not None:
        lock.take()  # a new directory is made here, after the task: a bad task leaves nothing behind
        prepare_run_dir(run_dir, resume, overwrite)
    dist.barrier()
    model, tokenizer, kernels = build_policy(cfg, plan)
    if checkpoint is not None:
        load_policy_weights(checkpoint, model)  # before sharding: a checkpoint holds whole tensors
    if plan.fsdp:
        kernels += f"; FSDP2: {shard_sharded_run(cfg, plan, model)} blocks fully_shard'ed over {dist.world} ranks"
    if plan.device.type == "cpu":
        kernels += f"; {threads}"  # how many torch threads, and why (llmrl/threads.py)
    checkpoints = f"checkpoints (eval --run, chat, export): {precision_rule(None, TRAINED_DTYPE, cfg.dtype)[1]}"
    if dist.is_main:
        print(f"llmrl: {plan.precision}" + (f"\nllmrl: {kernels}" if plan.device.type == "cpu" else "")
              + f"\nllmrl: {checkpoints}", file=sys.stderr)
    if dist.enabled:
        torch.manual_seed(mix(cfg.seed, 1 + dist.rank))  # per-rank stream for LoRA dropout
    report = getattr(task, "data_report", None)
    params = [p for p in model.parameters() if p.requires_grad]
    # full weights: AdamW's fused kernel (one pass over each tensor, CPU and CUDA) instead of a loop of ~10 ops per tensor
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
                                  fused=True if plan.full and not plan.fsdp else None)
    shuffle = torch.Generator().manual_seed(cfg.seed + 1)
    start, totals, health = 1, Totals(), Health()
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, shuffle, weights=False)
        restore_rank_rng(state, cfg, dist)
        task.load_state_dict(state["task"])
        start, totals = state["step"] + 1, Totals(**state["totals"])
        if dist.is_main:
            print(f"llmrl: resuming {run_dir} from {checkpoint.name} (step {state['step']} of {cfg.steps})", file=sys.stderr)
            saved_world = state.get("world_size", 1)
            if saved_world != dist.world:  # allowed (checkpoints hold whole or resharded tensors), but said
                how = "unsharded, each process holding the whole model" if cfg.shard == "fsdp" and not plan.fsdp else ""
                print(f"llmrl: note: {checkpoint.name} was written by {saved_world} process(es), this resume runs "
                      f"{dist.world}{': ' + how if how else ''} (the same run within float rounding; "
                      f"`--nproc {saved_world}` resumes as it ran)", file=sys.stderr)
        health = Health(**state.get("health", {}))
    notes = [plan.precision, kernels, checkpoints] if plan.device.type == "cpu" else [plan.precision, checkpoints]
    try:
        if report and dist.is_main:
            print(f"llmrl: {cfg.task} data: {json.dumps(report)}", file=sys.stderr)
            write_atomically(run_dir / DATA_REPORT, json.dumps(report, indent=1))
        if dist.is_main and checkpoint is None:  # resumed: config.yaml stays its checkpoint's until the next save
            save_config(cfg, run_dir / CONFIG, resolved=notes)
        if dist.is_main and checkpoint is not None:
            check_log_sizes(run_dir, state.get("logs", {}), checkpoint.name)
        logger = RunLogger(run_dir, cfg.to_dict(), enabled=dist.is_main, use_wandb=cfg.wandb, project=cfg.wandb_project,
                           name=cfg.run_name, resume_step=start - 1 if checkpoint else None,
                           use_tensorboard=cfg.tensorboard)
    except OSError as e:
        after = (f"its checkpoints are intact: fix the cause and run `{resume_command(cfg, run_dir)}`" if checkpoint
                 else "fix the cause and start again (--overwrite replaces what was written)")
        raise RunStopped(f"could not write {e.filename or run_dir}: {e.strerror or e}; {after}") from None
    episodes = environment_runner(cfg, task, model, tokenizer)
    engine = make_engine(cfg, plan, tokenizer, episodes.limits)
    # the update's settings, once: the loss and KL as configured, the plan's speed paths, and Dr. GRPO's constant
    # (and the overlong penalty's budget) taken against the episode's token budget
    update = UpdateSettings(
        algo=cfg.algo, loss=dataclasses.replace(cfg.loss_settings, max_tokens=episodes.limits.episode_tokens),
        ppo_epochs=cfg.ppo_epochs, minibatch_size=cfg.minibatch_size, grad_accum_steps=cfg.grad_accum_steps,
        kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef, kl_estimator=cfg.kl_estimator, kl_agg=cfg.kl_agg,
        max_grad_norm=cfg.max_grad_norm, shared_prefix=plan.shared_prefix_update, fuse_accumulation=plan.fuse_accumulation,
        token_budget=plan.token_budget, mismatch=cfg.mismatch_correction, mismatch_cap=cfg.mismatch_cap,
        engine_old=plan.engine_old)
    run = Run(cfg=cfg, plan=plan, dir=run_dir, dist=dist, model=model, tokenizer=tokenizer, task=task, engine=engine,
              optimizer=optimizer, shuffle=shuffle, logger=logger, start=start, resumed_from=checkpoint,
              config_notes=notes, lock=lock, totals=totals, health=health, learned=start - 1, episodes=episodes,
              update=update)
    run.rollouts = RolloutSource(run, plan.one_ahead)
    return run


def shard_sharded_run(cfg: TrainConfig, plan: Plan, model) -> int:
    """--shard fsdp: fully_shard the policy (and, for full weights with a KL term, a frozen copy of the base as its
    reference, sharded the same way); returns the number of blocks sharded."""
    from llmrl.models.full import ShardedReference, prepare_full
    from llmrl.training.fsdp import shard_policy

    if plan.full and plan.with_ref:
        base, _ = load_base_model(cfg.model, plan.device, plan.dtype)
        reference = prepare_full(base, False, reference=False, autocast=plan.autocast).requires_grad_(False).eval()
        shard_policy(reference, plan.world_size)
        model.llmrl_reference = ShardedReference(reference)
    return shard_policy(model, plan.world_size)


def environment_runner(cfg: TrainConfig, task: Task, model, tokenizer) -> EpisodeRunner:
    """The episode runner of the task: a multi-turn environment's (its chat-template check included), or
    a single-turn task's one-turn episodes (`OneTurn`): every rollout is made by run_episodes."""
    env = task if is_environment(task) else OneTurn(task)
    return episode_runner(cfg, env, tokenizer, eos_ids(model, tokenizer), next(model.parameters()).device)


def save(run: Run, step: int) -> Path | None:
    """Checkpoint the run after `step` (rank 0 writes; every rank's dropout RNG goes with it), then config.yaml.
    Any failed write (a full disk, an I/O error) stops the run in one line naming the checkpoint it kept, on every
    rank: a failure of rank 0's own writes is shared, so the other ranks stop with it instead of waiting for it at
    the next collective. Returns the checkpoint's path on rank 0 (None on the others)."""
    rank_rng = run.dist.gather(rank_rng_state())
    short = free_space_problem(run.dir, space_needed(run.model)) if run.dist.is_main else None
    if run.dist.any(short is not None):  # before any rank writes: a full disk stops the run with nothing half-written
        raise RunStopped(f"could not write the checkpoint of step {step}: {short}; {kept_checkpoint(run)}",
                         every_rank=True)
    sharded = write_rank_shards(run, step) if run.plan.fsdp and run.plan.full else None  # every rank writes its shards
    whole = full_state(run.model, run.optimizer) if run.plan.fsdp and not run.plan.full else None  # LoRA: gathered
    path, failed = None, None
    if run.dist.is_main:
        try:
            path = write_checkpoint(run, step, rank_rng, whole, sharded)
        except RunStopped as e:
            failed = e
    if run.dist.any(failed is not None):
        raise failed or RunStopped(f"rank 0 could not write the checkpoint of step {step}", every_rank=True)
    if path is not None:
        hooks.fire("after_checkpoint", path=path)
    return path


def write_checkpoint(run: Run, step: int, rank_rng: list, whole: tuple | None, sharded: Path | None) -> Path:
    """Rank 0's part of `save`: the checkpoint's files (around the shards every rank wrote, if sharded) and
    config.yaml; a failed write is RunStopped naming the checkpoint kept."""
    drawn_from = run.rollouts.drawn_from if run.rollouts is not None else {}
    task_state = drawn_from[min(drawn_from)] if drawn_from else run.task.state_dict()
    problem = task_state_problem(task_state)
    if problem:
        if sharded:
            shutil.rmtree(sharded, ignore_errors=True)
        raise RunStopped(f"step {step}: the task's {problem}, so it cannot be checkpointed; {kept_checkpoint(run)}")
    state = {"task": task_state, "totals": vars(run.totals), "health": vars(run.health), "config": run.cfg.to_dict(),
             "world_size": run.dist.world}
    extra = {f"{kind}_rank{r}": t for r, states in enumerate(rank_rng) for kind, t in states.items()} if run.dist.enabled else {}
    try:
        state["logs"] = run.logger.durable_sizes()  # what a resume must find in the logs, at least
        path = save_checkpoint(run.dir, step, run.model, run.optimizer, state, run.shuffle, keep=run.cfg.keep_checkpoints,
                               extra_rng=extra, base_model=run.cfg.model, card=model_card(run.cfg, step, run.dir),
                               whole=whole, sharded=sharded)
    except OSError as e:
        raise RunStopped(f"could not write the checkpoint of step {step}: {e.strerror or e}; "
                         f"{kept_checkpoint(run)}") from None
    try:
        save_config(run.cfg, run.dir / CONFIG, resolved=run.config_notes)  # what the next --resume checks
    except OSError as e:
        raise RunStopped(f"could not write {run.dir / CONFIG}: {e.strerror or e}; checkpoint {path} (step {step}) is "
                         f"complete: fix the cause and run `{resume_command(run.cfg, run.dir)}`") from None
    return path


def write_rank_shards(run: Run, step: int) -> Path:
    """FSDP2 full weights: every rank writes its shards of the weights and AdamW state (DCP) into one new temporary
    checkpoint directory (made by rank 0), which save_checkpoint completes; a failed write stops every rank in one
    line, the temporary directory removed and the previous checkpoint intact."""
    made: Path | OSError | None = None
    if run.dist.is_main:
        try:
            made = checkpoint_tmp(run.dir, step)
        except OSError as e:
            made = e
    shared = run.dist.gather(str(made) if isinstance(made, Path) else "")[0]
    if not shared:  # rank 0 could not make the directory: every rank stops
        why = made.strerror or made if isinstance(made, OSError) else "rank 0 could not make its directory"
        raise RunStopped(f"could not write the checkpoint of step {step}: {why}; {kept_checkpoint(run)}",
                         every_rank=True)
    tmp = Path(shared)
    try:
        save_sharded(run.model, run.optimizer, tmp)
    except BaseException as e:  # DCP's CheckpointException (every rank's error, raised on all) is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        why = failure_line(e)
        if run.dist.is_main:
            if disk_full(tmp):  # torch's writer may report a short write as "unexpected pos ..." instead of ENOSPC
                why = f"{os.strerror(errno.ENOSPC)} ({why})"
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunStopped(f"could not write the checkpoint of step {step}: {why}; {kept_checkpoint(run)}",
                         every_rank=True) from None
    return tmp


def kept_checkpoint(run: Run) -> str:
    """The end of a stop's line when a checkpoint could not be written: which one a resume will use."""
    previous = latest_checkpoint(run.dir, report=lambda _: None)
    if previous is None:
        return "no checkpoint was written before this one: fix the cause and start again"
    return f"the previous checkpoint ({previous}) is intact: fix the cause and run `{resume_command(run.cfg, run.dir)}`"


def eval_count(cfg: TrainConfig, task: Task) -> int:
    """eval_n, else the task's default (64 for format_copy, 512 for math_hard)."""
    return cfg.eval_n if cfg.eval_n is not None else task.eval_n_default


def eval_max_new_tokens(cfg: TrainConfig, task: Task) -> int:
    """eval_max_new_tokens, else max_new_tokens capped by the task's own eval cap (format_copy: 24)."""
    return cfg.eval_max_new_tokens or min(cfg.max_new_tokens, getattr(task, "eval_max_new_tokens", cfg.max_new_tokens))


def eval_policy(cfg: TrainConfig, model, tokenizer, task: Task, engine: RolloutEngine | None = None,
                dist: Dist | None = None, episodes: EpisodeRunner | None = None, version: int = 0,
                plan: Plan | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Eval of `model` (policy version `version`: the RL steps it has learned) on the task's first eval_n
    examples (`llmrl eval`, and the run's evals): greedy, or eval_samples_per_prompt sampled completions each."""
    max_new = eval_max_new_tokens(cfg, task)
    sampling = Sampling(temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, top_k=0, repetition_penalty=1.0,
                        min_new_tokens=0, max_new_tokens=max_new, max_prompt_tokens=cfg.max_prompt_tokens)
    episodes = episodes or environment_runner(cfg, task, model, tokenizer)
    engine = engine or make_engine(cfg, plan or resolve(cfg), tokenizer, episodes.limits)
    engine.load(model, version)
    # eval replies get eval's token cap (a single-turn task's episode is its one reply)
    limits = dataclasses.replace(episodes.limits, reply_tokens=max_new,
                                 episode_tokens=max_new if episodes.single_turn else episodes.limits.episode_tokens)
    metrics, rows = evaluate(engine, task, task.eval_examples(eval_count(cfg, task)),
                             episodes=dataclasses.replace(episodes, limits=limits), batch=cfg.eval_batch_size,
                             dist=dist, samples_per_prompt=cfg.eval_samples_per_prompt, sampling=sampling, seed=cfg.seed)
    return plain(metrics), plain(rows)  # a custom task's evaluate() and answers may hold NumPy/torch numbers


def evaluate_and_log(run: Run, step: int) -> dict[str, float]:
    """Evaluate, log the metrics and completions, refresh the report."""
    t0 = time.perf_counter()
    with gathered(run.model):  # FSDP2: eval generates on the whole model (a no-op unsharded)
        metrics, rows = eval_policy(run.cfg, run.model, run.tokenizer, run.task, run.engine, run.dist, run.episodes,
                                    version=step)
    metrics["time/eval_s"] = time.perf_counter() - t0
    hint = getattr(run.task, "unread_hint", None)  # a dataset's grader (tasks/dataset.py), once per run (health.py)
    unread = hint([r["answer"] for r in rows], [r["completion"] for r in rows]) if hint else None
    if (unread := run.health.once("unread", unread)) and run.dist.is_main:
        tqdm.write(f"llmrl: warning: eval at step {step}: {unread}", file=sys.stderr)
    run.logger.log(step, metrics | ({"warnings": [unread]} if unread else {}))
    run.logger.log_samples(step, rows, eval=True)
    if run.dist.is_main and run.cfg.report and not run.logger.failed:
        from llmrl.report import refresh_run_report

        try:
            refresh_run_report(run.dir)  # a plotting problem only warns; a failing disk stops the run, as for the logs
        except OSError as e:
            run.logger.fail(e.filename or run.dir / REPORT, e)
    return metrics


class StopOnSignal:
    """SIGINT/SIGTERM: the first asks the loop to stop after the current step (it saves a checkpoint);
    a second exits at once. Checkpoints are atomic, so exiting mid-save loses nothing either."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
            if getattr(self.previous[signal.SIGINT], "seen", False):  # the CLI's Ctrl-C came during set-up, and a
                self.__exit__()  # library swallowed its exception (seen: mid-import): no step starts
                raise KeyboardInterrupt
        return self

    def handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            print(f"\nllmrl: second {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal = signal.Signals(signum).name
        print(f"\nllmrl: {self.signal}: stopping after this step (again to exit at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
