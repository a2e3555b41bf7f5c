"""The training loop: sample → reward → advantage → update → log → eval → save, one step at a time.

    run = setup_run(cfg)                          run dir, resume, policy, optimizer, loggers (training/run.py)
    eval before step 1                            the untrained policy, for comparison
    for step in start..steps:
        result = train_step(run, step)            collect (sample, reward, advantages), learn (training/step.py)
        log     metrics.jsonl (+ samples.jsonl every sample_log_interval steps)
        eval    every eval_interval steps and at the end
        save    every save_interval steps, at the end, and when a signal asks to stop
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from llmrl.checkpoint import checkpoint_dir, latest_checkpoint
from llmrl.config import TrainConfig, check_resume_config, preflight
from llmrl.errors import EngineDied, RunStopped
from llmrl.tasks import resume_command
from llmrl.tasks.score import ReservedName
from llmrl.threads import StepThreads
from llmrl.training.run import Run, StopOnSignal, evaluate_and_log, kept_checkpoint, save, setup_run
from llmrl.training.step import train_step


@dataclass
class TrainResult:
    model: Any  # the trained PeftModel
    tokenizer: Any
    run_dir: Path
    last_metrics: dict[str, Any]
    adapter: Path | None = None  # the last checkpoint written (None on other ranks)
    stopped_by: str | None = None  # the signal that stopped the run before its last step (SIGINT, SIGTERM), else None


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, start_lines: list[str] = ()) -> TrainResult:
    """Train a LoRA policy with `cfg`; with `resume`, continue from the newest good checkpoint of
    output_dir; with `overwrite`, replace a run already in output_dir. `start_lines`: lines about how the config
    was made (load_config's notes), printed once the task's data has loaded."""
    if resume:
        check_resume_config(Path(cfg.output_dir))  # a damaged config.yaml: one line before anything loads
    preflight(cfg)  # a missing vLLM, a missing model or an unreachable hub: one line, before the run directory
    run = setup_run(cfg, resume, overwrite, start_lines)
    try:
        return train_run(run)
    finally:
        run.rollouts.close()
        run.engine.close()  # vllm-server: the child server stops on every exit path (SIGKILL: its parent-death signal)
        if run.lock is not None:
            run.lock.release()


def train_run(run: Run) -> TrainResult:
    """The loop of train() on a set-up run."""
    cfg = run.cfg
    if run.start > cfg.steps:
        if run.dist.is_main:
            print(f"llmrl: {run.dir} already ran its {cfg.steps} steps; nothing to do (give --steps N to continue); "
                  f"adapter: {run.resumed_from}", file=sys.stderr)
        close_run(run)
        return TrainResult(model=run.model, tokenizer=run.tokenizer, run_dir=run.dir, last_metrics={}, adapter=run.resumed_from)
    try:
        if run.eval_n > 0 and cfg.eval_interval > 0 and run.resumed_from is None:
            evaluate_and_log(run, 0)  # the untrained policy, for comparison
            if logs_failed(run):
                raise stop_after_failed_logs(run)
        return loop(run)
    except (EngineDied, ReservedName) as e:
        raise stop_with_checkpoint(run, str(e)) from None


def close_run(run: Run) -> None:
    """The end of a run: logs closed, then the ranks meet, then the engine (a vLLM engine per rank takes the
    process group down with it), then the process group."""
    run.logger.close()
    run.dist.barrier()
    run.engine.close()
    run.dist.close()


LOGS_FAILED_ELSEWHERE = "rank 0 could not write the run's logs"


def logs_failed(run: Run) -> bool:
    """True on every rank once rank 0's logger has failed to write (a full disk, an I/O error)."""
    return run.dist.any(run.logger.failed is not None)


def stop_after_failed_logs(run: Run) -> RunStopped:
    """A log write failed. If a step's metrics or samples rows went with it, stop at the last complete checkpoint
    (a resume cuts the logs back to it and redoes the steps after it, so each step is logged once, as after a
    SIGKILL); if only the report failed, save this step first."""
    reason = run.logger.failed or LOGS_FAILED_ELSEWHERE
    if run.dist.any(run.logger.lost_rows):
        return RunStopped(f"{reason}; {kept_checkpoint(run)}", every_rank=True)
    return stop_with_checkpoint(run, reason, every_rank=True)


def stop_with_checkpoint(run: Run, reason: str, every_rank: bool = False) -> RunStopped:
    """The run cannot go on (its engine's server went away, a log write failed): checkpoint the last step learned
    (unless it is saved already) and say where, in one line. The model, optimizer and shuffle are those of that
    step (a rollout changes none of them) and the task's state is from before the unlearned step's prompts, so
    --resume continues exactly. If that save fails too, the line says so and names the checkpoint kept. every_rank:
    every rank stops here together (rank 0 alone prints the line)."""
    done = run.learned
    latest = latest_checkpoint(run.dir, report=lambda _: None)
    try:
        path = latest if latest == checkpoint_dir(run.dir, done) else save(run, done)
    except RunStopped as e:
        return RunStopped(f"{reason}; {e}", every_rank=every_rank)
    return RunStopped(f"{reason}; checkpoint {path} (step {done}); resume with: {resume_command(run.cfg, run.dir)}",
                      every_rank=every_rank)


def loop(run: Run) -> TrainResult:
    """Steps run.start..steps: train_step, log, eval, save."""
    cfg, last, path, stopped_by = run.cfg, {}, None, None
    bar = tqdm(range(run.start, cfg.steps + 1), initial=run.start - 1, total=cfg.steps, disable=not run.dist.is_main,
               desc="train")
    threads = StepThreads.begin(cfg.num_threads, run.plan.device.type == "cpu")  # None: the thread count stays
    with StopOnSignal() as stop:
        for step in bar:
            t0 = time.perf_counter()
            result = train_step(run, step)  # sample, reward, advantages, update
            retune_threads(run, threads, step, time.perf_counter() - t0)
            last, warnings = result.metrics, log_step(run, step, result, bar)  # metrics.jsonl, samples.jsonl
            final = step == cfg.steps
            stopping = run.dist.any(stop.signal is not None)  # a signal on any rank stops every rank after this step
            stop_if_unhealthy(run, step, warnings)
            if run.eval_n > 0 and (final or (cfg.eval_interval and step % cfg.eval_interval == 0)) and not logs_failed(run):
                run.rollouts.settle()  # eval loads version `step`: not while the next step's draw is in flight
                last |= evaluate_and_log(run, step)
            if logs_failed(run):
                raise stop_after_failed_logs(run)
            if final or (cfg.save_interval and step % cfg.save_interval == 0) or stopping:
                path = save(run, step)
            if stopping and not final:
                bar.close()
                stopped_by = stop.signal or "SIGTERM"  # another rank's signal: torchrun sends SIGTERM
                if run.dist.is_main:
                    print(f"llmrl: stopped by {stop.signal or 'a signal on another rank'} after step {step}; "
                          f"checkpoint {path}\nllmrl: resume with: {resume_command(run.cfg, run.dir)}", file=sys.stderr, flush=True)
                break
    close_run(run)
    if run.dist.is_main and path is not None:
        if run.plan.fsdp and run.plan.full:  # DCP shards (run.save): from_pretrained cannot read them, export can
            how = f"DCP shards: `llmrl export {run.dir}` writes a model AutoModelForCausalLM.from_pretrained loads"
        else:
            loader = "AutoModelForCausalLM.from_pretrained" if run.plan.full else "PeftModel.from_pretrained"
            how = f"load it with {loader}, or `llmrl export {run.dir}`"
        print(f"llmrl: {'model' if run.plan.full else 'adapter'}: {path} ({how})", file=sys.stderr)
    return TrainResult(model=run.model, tokenizer=run.tokenizer, run_dir=run.dir, last_metrics=last, adapter=path,
                       stopped_by=stopped_by)


def retune_threads(run: Run, threads: StepThreads | None, step: int, seconds: float) -> None:
    """Automatic threads on CPU: set the count for the next step from other processes' load over this one
    (`seconds`: how long train_step took); rank 0 prints what changed, once."""
    for line in threads.after_step(step, seconds) if threads is not None else ():
        if run.dist.is_main:
            tqdm.write(f"llmrl: {line}", file=sys.stderr)


def log_step(run: Run, step: int, result, bar) -> list[str]:
    """Write the step's metrics record (with the health check's warnings, also printed) and its samples;
    returns the warnings."""
    record = result.metrics
    warnings = run.health.check(run.cfg, record, result.unread)
    for text in warnings:
        if run.dist.is_main:
            tqdm.write(f"llmrl: warning: step {step}: {text}", file=sys.stderr)
    run.logger.log(step, record | ({"warnings": warnings} if warnings else {}))
    run.logger.log_samples(step, result.samples)
    bar.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record['train/kl']:.4f}", loss=f"{record['train/loss']:.4f}")
    return warnings


def stop_if_unhealthy(run: Run, step: int, warnings: list[str]) -> None:
    """A health warning under --strict_health, or max_bad_steps non-finite updates in a row: save, then stop in
    one line."""
    if "reward_errors" in run.health.active and any(w.startswith("every reward call failed") for w in warnings):
        path = save(run, step)
        raise RunStopped(f"step {step}: every reward call failed for {run.cfg.health_steps} steps in a row; "
                         f"--strict_rewards shows the first error (checkpoint {path})", every_rank=True)
    if warnings and run.cfg.strict_health:
        path = save(run, step)
        raise RunStopped(f"step {step}: stopped by --strict_health ({warnings[0].split(':')[0]}); checkpoint {path}",
                         every_rank=True)  # (the step's metrics, and so its warnings, are every rank's)
    if run.totals.bad_in_a_row >= run.cfg.max_bad_steps:
        path = save(run, step)
        raise RunStopped(f"step {step}: {run.totals.bad_in_a_row} non-finite updates in a row (max_bad_steps="
                         f"{run.cfg.max_bad_steps}); parameters are the last good ones, saved in {path}", every_rank=True)
