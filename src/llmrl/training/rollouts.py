"""Where a step's rollouts come from: `RolloutSource.draw(step)`, and `draw`, one round of prompts and G
rollouts each from the policy version the engine holds.

The source alone loads policy versions into the engine, holds the draw in flight (async) and keeps the task's
state from before the prompts of every step drawn and not yet learned (what a checkpoint saves, so a resumed
run draws those prompts again).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import torch

from llmrl.errors import RunStopped
from llmrl.rng import kept_rng_state
from llmrl.rollout import Rollout
from llmrl.rollout.prompts import prompt_length
from llmrl.tasks import Example
from llmrl.tasks.env import Episode
from llmrl.training import hooks


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step (the same on every rank: each completion's noise is keyed by it,
    its global prompt index and its place in the group), so resume and reruns draw the same completions."""
    return (seed * 1_000_003 + step * 7_919) % (2**63)


@dataclass
class Drawn:
    """One round of a step's rollouts as the engine returned them, before any trainer forward."""

    examples: list[Example]  # this rank's prompts
    skipped: int  # prompts redrawn for being too long (long_prompts=skip)
    rollout: Rollout  # G rows per prompt, rollout.version = the policy version that drew them
    episodes: list[Episode] | None  # environments: the episodes the rows hold
    generate_s: float


def draw(run, step: int, version: int, rounds: int = 0, need: int | None = None) -> Drawn:
    """`need` prompts (batch_size; with long_prompts=skip, prompts over max_prompt_tokens are redrawn and
    counted) and G rollouts each from the policy the engine holds, which is version `version` (loaded by the
    caller). It neither reads nor changes the trainer's weights, so a thread may run it while the trainer
    learns (max_staleness). Every rank draws the same prompts and rolls out its contiguous share."""
    cfg = run.cfg
    n, examples, skipped = need or cfg.batch_size, [], 0
    if cfg.long_prompts == "truncate":
        with kept_rng_state():  # the task's own RNG draws; a library's may reseed the global ones
            examples = run.task.sample_train_batch(n)
    while len(examples) < n and cfg.long_prompts == "skip":
        with kept_rng_state():
            batch = run.task.sample_train_batch(n - len(examples))
        for ex in batch:
            if prompt_length(run.tokenizer, ex.messages, getattr(run.episodes.env, "tool_schemas", None)) <= cfg.max_prompt_tokens:
                examples.append(ex)
            else:
                skipped += 1
        if skipped > 100 * cfg.batch_size:
            raise RunStopped(f"long_prompts=skip: {skipped} prompts in a row exceed max_prompt_tokens={cfg.max_prompt_tokens}")
    first, stop = run.dist.shard(len(examples))
    examples = examples[first:stop]
    hooks.fire("before_rollout", step=step)
    t0 = time.perf_counter()
    seed = step_seed(cfg.seed, step) + 7_777 * rounds
    # token-in/token-out episodes (a single-turn task's have one turn), noise keyed (seed, prompt, g, turn)
    out, episodes = run.episodes(run.engine, examples, group_size=cfg.group_size, seed=seed, first_prompt=first,
                                 sampling=run.engine.sampling)
    run.engine.release()  # vLLM on CUDA sleeps now: the old/ref forwards get its memory (load wakes it)
    out.version = torch.full((out.input_ids.shape[0],), version, dtype=torch.long, device=out.input_ids.device)
    return Drawn(examples, skipped, out, None if run.episodes.single_turn else episodes, time.perf_counter() - t0)


class RolloutSource:
    """The rollouts of each step, in order. Synchronous: step s is drawn from the policy before it (version
    s-1, lag 0). One step ahead (plan.one_ahead, max_staleness 1): while step s learns, a thread draws step
    s+1 from version s-1, so each batch is one version old when it is learned (lag 1; the first step after a
    start or a resume is drawn synchronously).

    The engine is loaded only on the main thread and never while a draw is in flight (`settle` before an eval,
    which loads another version). `drawn_from[s]` is the task's state before step s's prompts for every step
    drawn and not yet learned; a checkpoint saves the oldest, and the step drops its own once learned.
    """

    def __init__(self, run, one_ahead: bool) -> None:
        self.run = run
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmrl-draw") if one_ahead else None
        self.pending: tuple[int, concurrent.futures.Future] | None = None  # (step, its draw)
        self.drawn_from: dict[int, dict[str, Any]] = {}

    def draw(self, step: int) -> Drawn:
        """The first round of step `step`'s rollouts (its errors, e.g. a dead server, raise here); one step
        ahead, the next step's draw starts before this returns."""
        run = self.run
        if self.pending is not None and self.pending[0] == step:
            future, self.pending = self.pending[1], None
            drawn = future.result()
        else:
            t0 = time.perf_counter()
            run.engine.load(run.model, step - 1)  # vllm: the adapter (counted in generate_s)
            load_s = time.perf_counter() - t0
            self.drawn_from.setdefault(step, run.task.state_dict())
            drawn = draw(run, step, step - 1)
            drawn.generate_s += load_s
        if self.pool is not None and step < run.cfg.steps:  # drawn while this step learns
            run.engine.load(run.model, step - 1)
            self.drawn_from[step + 1] = run.task.state_dict()
            self.pending = (step + 1, self.pool.submit(draw, run, step + 1, step - 1))
        return drawn

    def settle(self) -> None:
        """Wait until the in-flight draw is done (its result or error stays for `draw`)."""
        if self.pending is not None:
            concurrent.futures.wait([self.pending[1]])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
