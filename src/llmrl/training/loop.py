"""The training loop: sample → reward → advantage → update → log → eval → save, one step at a time.

    for step in 1..steps:
        1. examples = task.sample_train_batch(B)              (the task's own seeded RNG)
        2. rollout  = G completions per prompt + old/ref log-probs (seed derived from seed, step, rank)
        3. rewards  = task.reward(example, text) for each     [N] and their components
                      (+ overlong / KL-in-reward terms; dynamic_sampling refills groups with equal rewards)
        4. adv      = clamp(ADVANTAGE_ESTIMATORS[adv_estimator](rewards, G), ±adv_clip) [N]
        5. update   = ppo_epochs × shuffled minibatches, loss LOSSES[algo] with cfg.loss_settings
                      (RATIOS[ratio_level], AGGREGATIONS[loss_agg], clip_eps_low/high), KL_ESTIMATORS[kl_estimator]
        6. log      metrics.jsonl (+ samples.jsonl every sample_log_interval steps)
        7. eval     every eval_interval steps and at the end (and once before step 1)
        8. save     every save_interval steps and at the end

Everything the next step needs lives in the model, the optimizer, the task's RNG and the shuffle
generator (the learning rate is a function of the step), which is exactly what a checkpoint holds,
so `--resume` continues the run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from llmrl.algorithms.core import (
    ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, masked_mean, normalize_advantages, overlong_penalty, zero_spread_fraction,
)
from llmrl.algorithms.losses import LOSSES
from llmrl.checkpoint import CHECKPOINTS, latest_checkpoint, load_checkpoint, remove_stale_temporaries, save_checkpoint
from llmrl.config import TrainConfig, resume_differences, save_config
from llmrl.errors import ConfigError, RunStopped
from llmrl.logger import EVAL_SAMPLES, METRICS, SAMPLES, RunLogger
from llmrl.models.loading import add_lora, load_base_model, pick_device, pick_dtype
from llmrl.models.packed_linear import available_memory_bytes, install_packed_linears, onednn_available, packable_linears
from llmrl.rollout.sampler import concat_rollouts, eos_ids, generation_config, mix, prompt_length, rollout, select_rows
from llmrl.training.cpu_speed import keep_heap_memory, use_hash_dropout
from llmrl.training.distributed import Dist, init_distributed
from llmrl.tasks import Example, Reward, Task, task_from_config
from llmrl.training.evaluate import evaluate
from llmrl.training.update import policy_update, warmup_factor


RUN_FILES = ("config.yaml", "data_report.json", METRICS, SAMPLES, EVAL_SAMPLES, CHECKPOINTS, "report.html", "plots", "tensorboard")


@dataclass
class TrainResult:
    model: Any  # the trained PeftModel
    tokenizer: Any
    run_dir: Path
    last_metrics: dict[str, Any]


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step (the same on every rank: each completion's noise is keyed by it,
    its global prompt index and its place in the group), so resume and reruns draw the same completions."""
    return (seed * 1_000_003 + step * 7_919) % (2**63)


def fuses_accumulation(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the minibatches of one optimizer step share one forward (and the reference pass runs
    that many rows at a time): `fuse_accumulation`, by default on for CPU under --fast."""
    return cfg.fast and (cfg.fuse_accumulation if cfg.fuse_accumulation is not None else device.type == "cpu")


def build_policy(cfg: TrainConfig):
    """(LoRA-wrapped model, tokenizer, device) for a config; LoRA init is seeded by cfg.seed."""
    device = pick_device(cfg.device)
    base, tokenizer = load_base_model(cfg.model, device, pick_dtype(cfg.dtype, device))
    torch.manual_seed(cfg.seed)
    model = add_lora(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules, cfg.gradient_checkpointing)
    if cfg.fast and cfg.hash_dropout and device.type == "cpu":
        use_hash_dropout(model)  # same distribution, a vectorised mask
    if cfg.fast and cfg.onednn_linear and device.type == "cpu":
        free = available_memory_bytes()  # the packs copy the frozen weights twice: only if that fits easily
        if not install_packed_linears(model, None if free is None else free // 2) and onednn_available() and packable_linears(model):
            print("llmrl: not enough free memory for oneDNN packed weights; frozen linears stay on F.linear",
                  file=sys.stderr)
    return model, tokenizer, device


def run_eval(cfg: TrainConfig, model, tokenizer, task: Task, dist: Dist | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    n = cfg.eval_n if cfg.eval_n is not None else task.eval_n_default
    return evaluate(
        model, tokenizer, task, task.eval_examples(n), batch_size=cfg.eval_batch_size,
        max_prompt_tokens=cfg.max_prompt_tokens, min_new_tokens=0,  # the starter's eval sets no minimum
        max_new_tokens=cfg.eval_max_new_tokens or min(cfg.max_new_tokens, getattr(task, "eval_max_new_tokens", cfg.max_new_tokens)),
        merge_lora=cfg.fast and cfg.merge_lora_sampling,
        dist=dist,
    )


def reward_metrics(rewards: list, adv: torch.Tensor, rewards_t: torch.Tensor, group_size: int) -> dict[str, float]:
    n = len(rewards)
    out = {"reward/mean": rewards_t.mean().item(), "reward/std": rewards_t.std(unbiased=False).item()}
    for name in dict.fromkeys(k for r in rewards for k in r.components):
        out[f"reward/{name}"] = sum(r.components.get(name, 0.0) for r in rewards) / n
    for name in dict.fromkeys(k for r in rewards for k in r.counts):
        out[f"reward/{name}"] = sum(r.counts.get(name, 0) for r in rewards)
    out |= {"adv/mean": adv.mean().item(), "adv/std": adv.std(unbiased=False).item(),
            "adv/min": adv.min().item(), "adv/max": adv.max().item(),
            "rollout/zero_spread_frac": zero_spread_fraction(rewards_t, group_size)}
    return out


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
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["config"]
    differ = resume_differences(saved, cfg)
    if differ:
        raise ConfigError(f"--resume {run_dir}: config differs from {checkpoint.name}: {', '.join(differ)}")
    return checkpoint


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


def safe_rewards(task: Task, examples: list[Example], texts: list[str], strict: bool, step: int) -> tuple[list[Reward], int]:
    """Score every completion (all at once if the task has `reward_batch`); a reward that raises or is
    not a finite number scores 0 and is counted (with `strict`, it stops the run instead)."""
    if hasattr(task, "reward_batch"):
        try:
            rewards = task.reward_batch(examples, texts)
            if len(rewards) == len(texts) and all(math.isfinite(float(r.total)) for r in rewards):
                return rewards, 0
        except Exception:  # noqa: BLE001 - find which completion fails, one by one
            pass
    rewards, errors = [], 0
    for ex, text in zip(examples, texts, strict=True):
        try:
            r = task.reward(ex, text)
            if not math.isfinite(float(r.total)):
                raise ValueError(f"reward is {r.total}")
        except Exception as e:  # noqa: BLE001 - a user's reward function may raise anything
            if strict:
                raise RunStopped(f"step {step}: the reward function raised {type(e).__name__}: {e} (--strict_rewards); "
                                 "the last checkpoint is intact") from None
            errors += 1
            r = Reward(total=0.0, components={})
        rewards.append(r)
    return rewards, errors


def draw_prompts(task: Task, tokenizer, cfg: TrainConfig, n: int) -> tuple[list[Example], int]:
    """n prompts; with long_prompts=skip, prompts over max_prompt_tokens are redrawn (counted)."""
    if cfg.long_prompts == "truncate":
        return task.sample_train_batch(n), 0
    kept: list[Example] = []
    skipped = 0
    while len(kept) < n:
        for ex in task.sample_train_batch(n - len(kept)):
            if prompt_length(tokenizer, ex.messages) <= cfg.max_prompt_tokens:
                kept.append(ex)
            else:
                skipped += 1
        if skipped > 100 * cfg.batch_size:
            raise RunStopped(f"long_prompts=skip: {skipped} prompts in a row exceed max_prompt_tokens={cfg.max_prompt_tokens}")
    return kept, skipped


# train/ statistics averaged over ranks before logging (the others are equal on every rank)
MEAN_STATS = ("loss", "pg_loss", "kl", "clip_frac", "clip_frac_low", "clip_frac_high", "entropy")


def restore_rank_rng(state: dict[str, Any], cfg: TrainConfig, dist: Dist) -> None:
    """Give each rank its own saved RNG stream back; if the checkpoint came from another world size,
    ranks without a saved stream start a fresh one (only LoRA dropout draws from it)."""
    if not dist.enabled:
        return
    saved = state.get("rank_rng", {}).get(f"torch_rank{dist.rank}")
    if saved is not None and state.get("world_size") == dist.world:
        torch.set_rng_state(saved)
        return
    torch.manual_seed(mix(cfg.seed, 1 + dist.rank, state["step"]))
    if dist.is_main:
        print(f"llmrl: resuming a {state.get('world_size', 1)}-process checkpoint on {dist.world} processes: same "
              "prompts, completions and updates; per-rank dropout RNG streams restart", file=sys.stderr)


def sample_and_score(model, tokenizer, task: Task, cfg: TrainConfig, gen_config, step: int, dist: Dist):
    """Steps 1-3 of the loop: B prompts, G completions each, their rewards.

    With dynamic_sampling (DAPO), groups whose rewards are all equal are set aside and more prompts are
    sampled (up to dynamic_sampling_rounds rounds) until B groups have a spread; set-aside groups fill
    whatever is still missing. With several ranks, every rank draws the same B prompts and samples
    its share (dynamic sampling is single-process). Returns (owners [n] examples, Rollout, rewards [n],
    counts for logging), n = this rank's completions.
    """
    g = cfg.group_size
    kept: list[tuple[list[Example], Any, list[Reward]]] = []  # groups with a reward spread
    flat: list[tuple[list[Example], Any, list[Reward]]] = []  # groups without
    counts = {"reward_errors": 0, "prompts_skipped": 0}
    rounds = 0
    while rounds < (cfg.dynamic_sampling_rounds if cfg.dynamic_sampling else 1) and len(kept) < cfg.batch_size:
        need = cfg.batch_size - len(kept) if cfg.dynamic_sampling else cfg.batch_size
        examples, skipped = draw_prompts(task, tokenizer, cfg, need)
        first, stop = dist.shard(len(examples))
        examples = examples[first:stop]
        out = rollout(
            model, tokenizer, [ex.messages for ex in examples], group_size=g, gen_config=gen_config,
            max_prompt_tokens=cfg.max_prompt_tokens, seed=step_seed(cfg.seed, step) + 7_777 * rounds,
            first_prompt=first,
            chunk=cfg.minibatch_size * (cfg.grad_accum_steps if fuses_accumulation(cfg, next(model.parameters()).device) else 1),
            with_ref=cfg.kl_coef > 0, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, logp_from_sampler=cfg.fast and cfg.logp_from_sampler,
            merge_lora=cfg.fast and cfg.merge_lora_sampling, shared_prefix=cfg.fast and cfg.shared_prefix,
        )
        owners = [ex for ex in examples for _ in range(g)]  # prompt-major, like the completions
        rewards, errors = safe_rewards(task, owners, out.texts, cfg.strict_rewards, step)
        counts["reward_errors"] += errors
        counts["prompts_skipped"] += skipped
        rounds += 1
        if not cfg.dynamic_sampling:
            return owners, out, rewards, counts
        for i in range(len(examples)):
            rows = list(range(i * g, (i + 1) * g))
            group = ([owners[j] for j in rows], select_rows(out, rows), [rewards[j] for j in rows])
            spread = len({r.total for r in group[2]}) > 1
            (kept if spread else flat).append(group)
    groups = kept[: cfg.batch_size] + flat[: max(0, cfg.batch_size - len(kept))]
    counts |= {"sampling_rounds": rounds, "groups_flat_dropped": len(flat) - max(0, cfg.batch_size - len(kept)),
               "groups_flat_kept": max(0, cfg.batch_size - len(kept))}
    return ([ex for grp in groups for ex in grp[0]], concat_rollouts([grp[1] for grp in groups], tokenizer.pad_token_id),
            [r for grp in groups for r in grp[2]], counts)


def reward_shaping(cfg: TrainConfig, out) -> dict[str, torch.Tensor]:
    """Terms added to the task's rewards, by name ([N] each): DAPO's soft overlong penalty, and the
    KL penalty −kl_coef · Σ_t KL_t when kl_in_reward."""
    terms: dict[str, torch.Tensor] = {}
    if cfg.overlong_buffer > 0:
        terms["overlong"] = overlong_penalty(out.completion_lens, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    if cfg.kl_in_reward:
        per_token = KL_ESTIMATORS[cfg.kl_estimator](out.logp_old, out.logp_ref) * out.completion_mask  # [N, L-1]
        terms["kl_penalty"] = -cfg.kl_coef * per_token.sum(1).float().cpu()
    return terms


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """Train a LoRA policy with `cfg`; with `resume`, continue from the newest good checkpoint of
    output_dir; with `overwrite`, replace a run already in output_dir."""
    dist = init_distributed(cfg.device, cfg.dist_timeout)
    rank, is_main = dist.rank, dist.is_main
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.fast and cfg.keep_heap_memory and pick_device(cfg.device).type == "cpu":
        keep_heap_memory()
    run_dir = Path(cfg.output_dir)
    checkpoint = find_resume_checkpoint(cfg, run_dir) if resume else None
    if is_main:
        prepare_run_dir(run_dir, resume, overwrite)
    dist.barrier()

    task = task_from_config(cfg)  # before the model: a bad task or data file fails fast (same prompts on every rank)
    model, tokenizer, device = build_policy(cfg)
    if dist.enabled:
        torch.manual_seed(mix(cfg.seed, 1 + rank))  # per-rank stream for LoRA dropout
    report = getattr(task, "data_report", None)
    if report and is_main:
        print(f"llmrl: {cfg.task} data: {json.dumps(report)}", file=sys.stderr)
        (run_dir / "data_report.json").write_text(json.dumps(report, indent=1))
    loss_fn, estimator = LOSSES[cfg.algo], ADVANTAGE_ESTIMATORS[cfg.adv_estimator]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    shuffle = torch.Generator().manual_seed(cfg.seed + 1)
    eos = eos_ids(model, tokenizer)
    gen_config = generation_config(  # greedy over the KeyedSampler's choice: sampling happens in rollout()
        tokenizer, eos, do_sample=False, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        repetition_penalty=cfg.repetition_penalty, min_new_tokens=cfg.min_new_tokens, max_new_tokens=cfg.max_new_tokens,
    )

    start = 1
    totals = {"optimizer_steps": 0, "skipped_updates": 0, "empty_minibatches": 0, "bad_in_a_row": 0, "reward_errors": 0,
              "prompts_skipped": 0, "completions": 0, "train_seconds": 0.0}
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, shuffle)
        restore_rank_rng(state, cfg, dist)
        task.load_state_dict(state["task"])
        start, totals = state["step"] + 1, state["totals"]
    if is_main:
        save_config(cfg, run_dir / "config.yaml")
    logger = RunLogger(run_dir, cfg.to_dict(), enabled=is_main, use_wandb=cfg.wandb, project=cfg.wandb_project,
                       name=cfg.run_name, resume_step=start - 1 if checkpoint else None, use_tensorboard=cfg.tensorboard)

    def evaluate_and_log(step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics, rows = run_eval(cfg, model, tokenizer, task, dist)
        metrics["time/eval_s"] = time.perf_counter() - t0
        logger.log(step, metrics)
        logger.log_samples(step, rows, eval=True)
        if is_main and cfg.report:
            from llmrl.report import refresh_run_report

            refresh_run_report(run_dir)  # never raises: a plotting problem must not stop training
        return metrics

    def save(step: int) -> Path | None:
        rank_rng = dist.gather(torch.get_rng_state())  # every rank's dropout stream, saved by rank 0
        if not is_main:
            return None
        state = {"task": task.state_dict(), "totals": totals, "config": cfg.to_dict(),
                 "world_size": dist.world}
        extra = {f"torch_rank{r}": t for r, t in enumerate(rank_rng)} if dist.enabled else {}
        try:
            return save_checkpoint(run_dir, step, model, optimizer, state, shuffle, keep=cfg.keep_checkpoints, extra_rng=extra)
        except OSError as e:
            previous = latest_checkpoint(run_dir, report=lambda _: None)
            raise RunStopped(f"could not write the checkpoint of step {step}: {e.strerror or e}; "
                             f"the previous checkpoint ({previous or 'none'}) is intact: fix the cause and "
                             f"run `llmrl train --resume {run_dir}`") from None

    eval_on = (cfg.eval_n if cfg.eval_n is not None else task.eval_n_default) > 0
    if eval_on and cfg.eval_interval > 0 and checkpoint is None:
        evaluate_and_log(0)  # the untrained policy, for comparison

    last: dict[str, Any] = {}
    bar = tqdm(range(start, cfg.steps + 1), initial=start - 1, total=cfg.steps, disable=not is_main, desc="train")
    with StopOnSignal() as stop:
        for step in bar:
            # 1-3. sample prompts, complete them G times, score the completions (DAPO: refill flat groups)
            t0 = time.perf_counter()
            for group in optimizer.param_groups:  # warmup counted in RL steps, as the starter does
                group["lr"] = cfg.lr * warmup_factor(step - 1, cfg.warmup_steps)
            owners, out, rewards, sampling = sample_and_score(model, tokenizer, task, cfg, gen_config, step, dist)
            rewards_t = torch.tensor([r.total for r in rewards], dtype=torch.float32)
            shaping = reward_shaping(cfg, out)  # overlong penalty, KL-in-reward: [N] each
            for name, values in shaping.items():
                rewards_t += values
                for r, v in zip(rewards, values.tolist()):
                    r.components[name] = v
            if cfg.overlong_filter:
                out.completion_mask[~out.ended] = 0.0  # truncated completions teach nothing
            rollout_s = time.perf_counter() - t0
            # every rank's share, in rank order (global row order): for advantages, logging and samples
            parts = dist.gather({"rewards": rewards, "rewards_t": rewards_t, "lengths": out.completion_lens.cpu(),
                                 "scored": out.completion_mask.sum(1).cpu(),
                                 "ended": out.ended.cpu(), "texts": out.texts, "owners": owners, "sampling": sampling,
                                 "prompts_truncated": out.prompts_truncated})
            local_rewards_t, rewards_t = rewards_t, torch.cat([p["rewards_t"] for p in parts])  # [N]
            rewards = [r for p in parts for r in p["rewards"]]
            row0 = sum(len(p["rewards"]) for p in parts[:rank])  # this rank's first global row

            # 4. advantages (over the global batch: every estimator is exact with any number of ranks)
            adv = estimator(rewards_t, cfg.group_size)
            if cfg.normalize_advantages:
                adv = normalize_advantages(adv, cfg.group_size)
            adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)

            # 5. update
            t0 = time.perf_counter()
            batch = {"input_ids": out.input_ids, "attention_mask": out.attention_mask, "completion_mask": out.completion_mask,
                     "logp_old": out.logp_old, "adv": adv[row0 : row0 + len(local_rewards_t)].to(device),
                     "group": torch.arange(len(local_rewards_t), device=device) // cfg.group_size}
            if out.logp_ref is not None:
                batch["logp_ref"] = out.logp_ref
            stats = policy_update(
                model, optimizer, batch, prompt_len=out.prompt_len, loss_fn=loss_fn, ppo_epochs=cfg.ppo_epochs,
                minibatch_size=cfg.minibatch_size, grad_accum_steps=cfg.grad_accum_steps, loss_settings=cfg.loss_settings,
                kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                max_grad_norm=cfg.max_grad_norm, generator=shuffle, dist=dist, offset=row0,
                lengths=torch.cat([p["scored"] for p in parts]).to(device),
                shared_prefix=cfg.fast and cfg.shared_prefix and not cfg.gradient_checkpointing,
                fuse_accumulation=fuses_accumulation(cfg, device),
            )
            stats["entropy"] = masked_mean(out.entropy, out.completion_mask).item()  # of the sampling policy, T = 1
            every_rank = dist.gather(stats)  # one collective for all the statistics
            stats = {k: sum(s[k] for s in every_rank) / dist.world if k in MEAN_STATS else v for k, v in stats.items()}
            update_s = time.perf_counter() - t0

            # 6. log
            steps_taken, skipped, trailing = stats.pop("optimizer_steps"), stats.pop("skipped_updates"), stats.pop("trailing_skips")
            empty = stats.pop("empty_minibatches")
            totals["bad_in_a_row"] = trailing if steps_taken else totals["bad_in_a_row"] + skipped
            totals["optimizer_steps"] += steps_taken
            totals["skipped_updates"] += skipped + empty
            totals["empty_minibatches"] = totals.get("empty_minibatches", 0) + empty
            sampling = {k: sum(p["sampling"][k] for p in parts) for k in sampling}
            totals["reward_errors"] += sampling.pop("reward_errors")
            totals["prompts_skipped"] += sampling.pop("prompts_skipped")
            totals["completions"] += len(rewards)
            totals["train_seconds"] += rollout_s + update_s
            lengths = torch.cat([p["lengths"] for p in parts]).float()
            ended = torch.cat([p["ended"] for p in parts])
            last = {
                **reward_metrics(rewards, adv, rewards_t, cfg.group_size),
                **{f"train/{k}": v for k, v in stats.items()},
                "train/optimizer_steps": totals["optimizer_steps"],
                "train/skipped_updates": totals["skipped_updates"],
                "train/empty_minibatches": totals["empty_minibatches"],
                "reward/errors": totals["reward_errors"],
                "rollout/completion_len": lengths.mean().item(),
                "rollout/completion_len_max": lengths.max().item(),
                "rollout/truncated_frac": (~ended).float().mean().item(),
                "rollout/prompts_truncated": sum(p["prompts_truncated"] for p in parts),
                "rollout/prompts_skipped": totals["prompts_skipped"],
                **{f"rollout/{k}": v for k, v in sampling.items()},
                "rollout/completions": totals["completions"],
                "time/rollout_s": rollout_s,
                "time/update_s": update_s,
                "time/train_s": totals["train_seconds"],
            }
            logger.log(step, last)
            if cfg.sample_log_interval and step % cfg.sample_log_interval == 0:
                logger.log_samples(step, [
                    {"prompt": ex.messages[-1]["content"], "answer": ex.answer, "completion": text, "reward": r.total,
                     "components": r.components, "advantage": a, "ended": bool(e)}
                    for ex, text, r, a, e in zip([o for p in parts for o in p["owners"]], [t for p in parts for t in p["texts"]],
                                                 rewards, adv.tolist(), ended.tolist())
                ])
            bar.set_postfix(reward=f"{last['reward/mean']:.3f}", kl=f"{last['train/kl']:.4f}", loss=f"{last['train/loss']:.4f}")

            # 7. eval, 8. save
            final = step == cfg.steps
            stopping = dist.any(stop.signal is not None)  # a signal on any rank stops every rank after this step
            if totals["bad_in_a_row"] >= cfg.max_bad_steps:
                path = save(step)
                raise RunStopped(f"step {step}: {totals['bad_in_a_row']} non-finite updates in a row (max_bad_steps="
                                 f"{cfg.max_bad_steps}); parameters are the last good ones, saved in {path}")
            if eval_on and (final or (cfg.eval_interval and step % cfg.eval_interval == 0)):
                last |= evaluate_and_log(step)
            if final or (cfg.save_interval and step % cfg.save_interval == 0) or stopping:
                path = save(step)
            if stopping and not final:
                bar.close()
                if is_main:
                    print(f"llmrl: stopped by {stop.signal or 'a signal on another rank'} after step {step}; "
                          f"checkpoint {path}\nllmrl: resume with: llmrl train --resume {run_dir}", file=sys.stderr, flush=True)
                break
    logger.close()
    dist.close()
    return TrainResult(model=model, tokenizer=tokenizer, run_dir=run_dir, last_metrics=last)
