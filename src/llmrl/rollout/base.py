"""What rollout engines share: the `Rollout` container, the engine interface, and `add_logprobs`,
which completes a rollout with its old and reference log-probs (engines generate; they do not score).

    engine.load(model, version)                          before each rollout: sample from exactly this policy
    engine.release()                                     after sampling, before the old/ref forwards and the update
    engine.continue_ids(contexts, keys, sampling, n)     one reply per context of token ids: every turn of every
                                                         rollout and eval (rollout/episodes.py; single-turn = one turn)
    with engine.episodes(): ...                          the turns of one rollout's episodes (one policy)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from llmrl.errors import EngineDied, RunStopped
from llmrl.models.full import reference_policy
from llmrl.models.scoring import chunked_logprobs, inference_mode
from llmrl.run_files import SCRATCH


def scratch_dir(run_dir: str | Path | None) -> Path:
    """A fresh directory for an engine's scratch adapters (the policy of each version, for vLLM to load):
    `RUN_DIR/.tmp-adapters-PID-XXXX` when the run directory exists and is writable (a killed process's is
    swept by the run's next start, checkpoint.remove_stale_temporaries), else one in the system's temp dir."""
    root = Path(run_dir) if run_dir is not None else None
    try:
        if root is not None and root.is_dir() and os.access(root, os.W_OK | os.X_OK):
            return Path(tempfile.mkdtemp(dir=root, prefix=f"{SCRATCH}{os.getpid()}-"))
        return Path(tempfile.mkdtemp(prefix=f"llmrl{SCRATCH[4:]}{os.getpid()}-"))
    except OSError as e:
        raise RunStopped(f"could not make a directory for the rollout engine's adapters in {root or tempfile.gettempdir()}: "
                         f"{e.strerror or e}; fix the cause and run the command again") from None


def write_adapter(model, path: Path) -> None:
    """model.save_pretrained(path) for an engine to load; a full disk or an I/O error (safetensors raises its
    own error for them) becomes EngineDied, so the loop checkpoints the last step and stops in one line."""
    from safetensors import SafetensorError

    from llmrl.checkpoint import as_os_error

    try:
        try:
            model.save_pretrained(str(path))
        except SafetensorError as e:
            raise as_os_error(e) from None
    except OSError as e:
        shutil.rmtree(path, ignore_errors=True)
        raise EngineDied(f"could not write the scratch adapter {path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class Sampling:
    """How training completions are drawn (the config's sampling fields)."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    min_new_tokens: int
    max_new_tokens: int
    max_prompt_tokens: int


@dataclass
class Rollout:
    """N = B*G completions of one RL step, prompt-major. L = prompt_len + generated length."""

    input_ids: torch.Tensor  # [N, L] left-padded prompt, then completion (padding after EOS)
    attention_mask: torch.Tensor  # [N, L] 0 on left padding, 1 elsewhere
    completion_mask: torch.Tensor  # [N, L-1] 1 where logp scores a generated token up to its EOS
    logp_old: torch.Tensor | None  # [N, L-1] behaviour policy log-probs (0 outside the completion); None
    #                                until add_logprobs when the engine does not return them
    logp_ref: torch.Tensor | None  # [N, L-1] reference log-probs, None when kl_coef = 0
    ended: torch.Tensor  # [N] bool: the completion ended with EOS (False: truncated)
    prompt_len: int  # width of the left-padded prompt block
    texts: list[str]  # decoded completions (without EOS)
    prompts_truncated: int  # prompts the engine cut to max_prompt_tokens in the generate call that made these rows
    #                         (select_rows keeps the call's count: metrics count per call, not from a selection)
    entropy: torch.Tensor | None = None  # [N, L-1] sampling-policy token entropies at temperature 1 (0 outside)
    engine_logp: torch.Tensor | None = None  # [N, L-1] the engine's own log-probs of the sampled tokens (vllm; 0 outside)
    version: torch.Tensor | None = None  # [N] the policy version each row was sampled from (RL steps learned before it)

    @property
    def completion_lens(self) -> torch.Tensor:
        """[N] number of scored tokens per completion (EOS included)."""
        return self.completion_mask.sum(1)

    @property
    def spans(self) -> torch.Tensor:
        """[N] each row's columns after the prompt block up to its last scored token (0 when none): its scored
        tokens for one reply, more for an episode (environment tokens lie between its replies)."""
        mask = self.completion_mask  # [N, L-1]: column P-1+j scores trajectory token j
        cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        return ((mask > 0) * cols).amax(1).sub(self.prompt_len - 1).clamp(min=0)


def select_rows(r: Rollout, rows: list[int]) -> Rollout:
    """The rollout restricted to `rows` (in that order)."""
    idx = torch.tensor(rows, dtype=torch.long, device=r.input_ids.device)
    return Rollout(
        input_ids=r.input_ids[idx], attention_mask=r.attention_mask[idx], completion_mask=r.completion_mask[idx],
        logp_old=None if r.logp_old is None else r.logp_old[idx], logp_ref=None if r.logp_ref is None else r.logp_ref[idx], ended=r.ended[idx],
        prompt_len=r.prompt_len, texts=[r.texts[i] for i in rows], prompts_truncated=r.prompts_truncated,
        entropy=None if r.entropy is None else r.entropy[idx],
        engine_logp=None if r.engine_logp is None else r.engine_logp[idx],
        version=None if r.version is None else r.version[idx],
    )


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rows of several rollouts in one: prompts left-padded to the widest prompt block, completions
    right-padded to the longest (padding is masked out: attention 0 on the left, completion mask 0)."""
    if len(parts) == 1:
        return parts[0]
    p = max(r.prompt_len for r in parts)
    t = max(r.input_ids.shape[1] - r.prompt_len for r in parts)

    def widen(x: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (left, right), value=value)

    def pads(r: Rollout) -> tuple[int, int]:
        return p - r.prompt_len, t - (r.input_ids.shape[1] - r.prompt_len)

    return Rollout(
        input_ids=torch.cat([widen(r.input_ids, *pads(r), pad_id) for r in parts]),
        attention_mask=torch.cat([widen(widen(r.attention_mask, pads(r)[0], 0, 0), 0, pads(r)[1], 1) for r in parts]),
        completion_mask=torch.cat([widen(r.completion_mask, *pads(r), 0) for r in parts]),
        logp_old=torch.cat([widen(r.logp_old, *pads(r), 0) for r in parts]),
        logp_ref=None if parts[0].logp_ref is None else torch.cat([widen(r.logp_ref, *pads(r), 0) for r in parts]),
        ended=torch.cat([r.ended for r in parts]), prompt_len=p, texts=[x for r in parts for x in r.texts],
        prompts_truncated=sum(r.prompts_truncated for r in parts),
        entropy=None if parts[0].entropy is None else torch.cat([widen(r.entropy, *pads(r), 0) for r in parts]),
        engine_logp=None if parts[0].engine_logp is None else torch.cat([widen(r.engine_logp, *pads(r), 0) for r in parts]),
        version=None if parts[0].version is None else torch.cat([r.version for r in parts]),
    )


@dataclass
class Reply:
    """One reply generated from exact token ids (multi-turn): its token ids (EOS included when it ended),
    whether it ended with EOS, and the engine's log-prob and entropy (T = 1) of each token (None when
    not computed)."""

    ids: list[int]
    ended: bool
    logp: list[float] | None = None
    entropy: list[float] | None = None


class RolloutEngine(Protocol):
    sampler_logp: bool  # the log-probs continue_ids returns are the trainer's own (hf fp32): the old log-probs

    def load(self, model, version: int) -> None:
        """Make the next continue_ids draw from `model`'s weights (adapter included), which are
        policy version `version` (the RL steps it has learned): an engine that already holds that version
        may skip the transfer, so a new version number is how an engine learns the weights changed."""

    def release(self) -> None:
        """Generation is over: free what the engine holds that the old/ref forwards and the update could use
        (vLLM sleep on CUDA)."""

    def continue_ids(self, contexts: list[list[int]], keys: list[int], sampling: Sampling, max_new_tokens: int,
                     greedy: bool = False, group_size: int = 1, logprobs: bool = True) -> list[Reply]:
        """Token-in/token-out: one reply per context of exact token ids (no chat template), noise keyed
        by keys (greedy: argmax); contexts come in runs of group_size equal ones (an engine may share
        their prefill). Every rollout and eval is made of these (rollout/episodes.py: a single-turn task's
        episodes have one turn). `logprobs` False (eval): no per-token log-probs or entropies come back."""

    def close(self) -> None:
        """The run is over (or failed): stop what the engine started (vllm-server: its server process)."""

    def episodes(self) -> AbstractContextManager:
        """The continue_ids calls of one rollout's episodes happen inside this (weights unchanged): an
        engine may keep each episode's KV cache from one turn to the next."""



def add_logprobs(model, r: Rollout, *, chunk: int, group_size: int, shared_prefix: bool, with_ref: bool,
                 token_budget: int = 2**62) -> Rollout:
    """Fill r.logp_old (when the engine did not) and r.logp_ref (the reference policy: LoRA disabled, or full weights' frozen base; when `with_ref`) with
    no-grad forwards of `chunk` rows, fewer where chunk × L would pass `token_budget` (rounded up to whole
    groups with `shared_prefix`, where each prompt runs once for its group); mask both, and the
    entropies, to the completion tokens."""
    group = torch.arange(r.input_ids.shape[0], device=r.input_ids.device) // group_size if shared_prefix else None
    chunk = max(1, min(chunk, token_budget // r.input_ids.shape[1]))
    chunk = -(-chunk // group_size) * group_size if shared_prefix else chunk  # a chunk holds whole groups
    with inference_mode(model):  # no LoRA dropout while scoring the behaviour policy
        if r.logp_old is None:
            r.logp_old, r.entropy = chunked_logprobs(model, r.input_ids, r.attention_mask, r.prompt_len, chunk, group,
                                                     with_entropy=True)
        r.logp_old = r.logp_old * r.completion_mask
        r.entropy = None if r.entropy is None else r.entropy * r.completion_mask
        if with_ref:
            with reference_policy(model) as reference:  # LoRA off, or the frozen base weights (finetune full)
                r.logp_ref = chunked_logprobs(reference, r.input_ids, r.attention_mask, r.prompt_len, chunk, group)[0]
            r.logp_ref = r.logp_ref * r.completion_mask
    return r
