"""The TRL side of `llmrl bench`: Hugging Face TRL's GRPOTrainer on the same model, prompts and settings.

Run by `llmrl bench` in its own process (so its peak RSS is its own):

    python -m llmrl.bench_trl --config_json '{...TrainConfig fields...}' --output_dir DIR

It trains `steps` RL steps and prints, as the last line of stdout, one JSON object with the per-RL-step
timings (see `run_trl`). TRL is imported only here, so llmrl works without it installed.

How TRL's steps map to RL steps (TRL 1.16, read from its GRPOTrainer):
    steps_per_generation = gradient_accumulation_steps (2), so one generation batch is
    per_device_train_batch_size × steps_per_generation = 8 × 2 = 16 completions = 4 prompts × 4.
    `_prepare_inputs` generates once every steps_per_generation × num_iterations = 4 micro-batches
    (`training_step` calls), and each optimizer step (`global_step`) is 2 micro-batches, so one
    generation serves num_iterations = 2 optimizer steps: epoch 1 is global step 2k−1, epoch 2 is
    global step 2k. One RL step (16 completions, both epochs) = `num_iterations` global steps, timed
    from `on_step_begin` of the first to `on_step_end` of the last. Generation happens inside the first
    of them (in `training_step` → `_prepare_inputs` → `_generate_and_score_completions`), which is
    wrapped with a timer: its time (generate, reward, old and reference log-probs) is the "rollout"
    time, the rest of the RL step the "update" time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time
from typing import Any


# llmrl loss_agg → TRL loss_type, as TRL 1.16's GRPOTrainer._compute_loss aggregates a micro-batch's per-token loss ℓ
# (mask m, M rows, divided by gradient_accumulation_steps like llmrl's loss):
#   seq_mean_token_mean (each row's masked token mean, then the mean over rows) = "grpo" (TRL's default is "dapo")
#   token_mean (Σ ℓ·m / Σ m over the minibatch) = "bnpo". Not "dapo": that divides each micro-batch's Σ ℓ·m by
#     the completion tokens of the whole generation batch (rescaled to one accumulation window), so the window's
#     loss is one token mean over all its micro-batches, which weighs them by their token counts
#   seq_mean_token_sum (Σ ℓ·m / (M·max_new_tokens)) = "dr_grpo"
LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "bnpo", "seq_mean_token_sum": "dr_grpo"}

# llmrl adv_estimator → TRL scale_rewards. group_mean (r − group mean) = "none" exactly. group_zscore ≈ "group":
# TRL divides by the group's Bessel std (n − 1) + 1e-4, llmrl by the population std (n) + 1e-6 (SPEC.md), a
# difference no TRL setting removes, so `definition_differences` states it. rloo and batch_zscore have no TRL twin
# (TRL's "batch" divides r − group mean by the Bessel std of the batch's rewards, not of those differences).
SCALE_REWARDS = {"group_zscore": "group", "group_mean": "none"}


def trl_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig keyword arguments equivalent to an llmrl config (dict of TrainConfig fields)."""
    rollout = cfg["batch_size"] * cfg["group_size"]
    if rollout != cfg["minibatch_size"] * cfg["grad_accum_steps"]:
        # TRL generates one generation batch of per_device_train_batch_size × gradient_accumulation_steps
        # completions per optimizer step; llmrl's config must be one optimizer step per epoch to match.
        raise ValueError(f"TRL side needs batch_size*group_size ({rollout}) == minibatch_size*grad_accum_steps "
                         f"({cfg['minibatch_size'] * cfg['grad_accum_steps']})")
    agg = cfg.get("loss_agg", "seq_mean_token_mean")
    if agg not in LOSS_TYPES:
        raise ValueError(f"TRL side: loss_agg={agg!r} has no TRL loss_type (known: {', '.join(LOSS_TYPES)})")
    estimator = cfg.get("adv_estimator", "group_zscore")
    if estimator not in SCALE_REWARDS:
        raise ValueError(f"TRL side: adv_estimator={estimator!r} has no TRL scale_rewards "
                         f"(known: {', '.join(SCALE_REWARDS)})")
    generation_kwargs = {"min_new_tokens": cfg["min_new_tokens"]} if cfg["min_new_tokens"] > 0 else None
    return dict(
        per_device_train_batch_size=cfg["minibatch_size"],
        gradient_accumulation_steps=cfg["grad_accum_steps"],
        num_generations=cfg["group_size"],
        num_iterations=cfg["ppo_epochs"],
        max_completion_length=cfg["max_new_tokens"],
        temperature=cfg["temperature"],
        top_p=cfg["top_p"],
        top_k=cfg["top_k"],
        repetition_penalty=cfg["repetition_penalty"],
        generation_kwargs=generation_kwargs,
        beta=cfg["kl_coef"],
        epsilon=cfg["clip_eps"] if cfg.get("clip_eps_low") is None else cfg["clip_eps_low"],
        epsilon_high=cfg.get("clip_eps_high"),  # None: epsilon
        importance_sampling_level=cfg.get("ratio_level", "token"),  # sequence: GSPO's exp(mean_t log ratio) both sides
        loss_type=LOSS_TYPES[agg],
        scale_rewards=SCALE_REWARDS[estimator],  # group_zscore: not the same std (definition_differences)
        use_bias_correction_kl=False,  # TRL 1.16's default multiplies the per-token KL by the ratio; llmrl does not
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant_with_warmup",  # llmrl: linear warmup, then constant
        warmup_steps=cfg["warmup_steps"] * cfg["ppo_epochs"],  # llmrl counts warmup in RL steps
        max_grad_norm=cfg["max_grad_norm"],
        adam_beta1=cfg["adam_beta1"],
        adam_beta2=cfg["adam_beta2"],
        weight_decay=cfg["weight_decay"],
        seed=cfg["seed"],
        max_steps=cfg["ppo_epochs"] * cfg["steps"],  # num_iterations optimizer steps per RL step
        shuffle_dataset=False,  # prompts in the order llmrl draws them
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def definition_differences(cfg: dict[str, Any]) -> list[str]:
    """What the TRL side computes differently from llmrl under `trl_settings(cfg)`, one line each (the
    bench prints them under its table): differences no TRL setting removes, verified in TRL 1.16's
    GRPOTrainer. cfg: dict of TrainConfig fields (missing ones take TrainConfig's defaults)."""
    lines = []
    group = cfg["group_size"]
    if cfg.get("adv_estimator", "group_zscore") == "group_zscore" and group > 1:
        lines.append(
            "advantages: TRL's scale_rewards=group divides r - group mean by the group's Bessel std (n-1) + 1e-4, "
            "llmrl's group_zscore by the population std (n) + 1e-6: TRL's advantages are llmrl's x "
            f"sqrt((G-1)/G) = {math.sqrt((group - 1) / group):.3f} at G={group} (spread well above 1e-4)")
    if cfg.get("normalize_advantages", False):
        lines.append("advantages: llmrl's normalize_advantages z-scores them over the batch; TRL does not")
    if cfg["temperature"] != 1:
        lines.append(f"log-probs: TRL divides the logits by the sampling temperature ({cfg['temperature']:g}) for the "
                     "old, new and reference log-probs; llmrl scores at temperature 1 (the seed's)")
    if cfg["kl_coef"] > 0:
        if cfg.get("kl_estimator", "k3") != "k3":
            lines.append(f"KL: TRL's per-token estimator is k3; llmrl's kl_estimator is {cfg['kl_estimator']}")
        agg = cfg.get("loss_agg", "seq_mean_token_mean")
        if cfg.get("kl_agg", "token_mean") == "token_mean" and agg != "token_mean":
            lines.append(f"KL: TRL adds beta*kl_t to the per-token loss, so loss_type={LOSS_TYPES.get(agg, agg)} "
                         "averages it like the policy term; llmrl's kl_agg=token_mean takes one token mean of kl_t "
                         "over the minibatch (kl_agg=loss_agg is TRL's)")
    return lines


def completion_text(completion: Any) -> str:
    """TRL passes a conversational completion as a list of messages; a plain one as a string."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion)


def run_trl(cfg: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """Train cfg["steps"] RL steps with TRL's GRPOTrainer; return per-RL-step figures:
    step_s, rollout_s, update_s, generate_s, completion_tokens (generated tokens of the step, EOS
    included), prompt_tokens (per group), plus n_params and max_rss_mb."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llmrl.models.loading import load_tokenizer
    from llmrl.tasks import make_task

    if cfg.get("num_threads"):
        torch.set_num_threads(cfg["num_threads"])
    use_cpu = cfg.get("device", "auto") == "cpu" or not torch.cuda.is_available()
    settings = trl_settings(cfg)
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    settings["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = (
        cfg["gradient_checkpointing"])
    # like for like: TRL's bf16 setting (bf16 autocast) wherever llmrl's dtype resolves to bf16 here
    from llmrl.models.loading import pick_dtype

    dtype, bf16_matmul, _ = pick_dtype(cfg.get("dtype", "auto"), torch.device("cpu" if use_cpu else "cuda"))
    settings["bf16"] = bf16_matmul or dtype == torch.bfloat16
    args = GRPOConfig(output_dir=output_dir, use_cpu=use_cpu, **settings)

    # the prompts llmrl draws: batch_size per step from the task's seeded RNG, in order
    task = make_task(cfg["task"], seed=cfg["seed"], math_data=cfg.get("math_data"))
    examples = [ex for _ in range(cfg["steps"]) for ex in task.sample_train_batch(cfg["batch_size"])]
    dataset = Dataset.from_list([{"prompt": ex.messages, "idx": i} for i, ex in enumerate(examples)])

    def task_reward(prompts, completions, idx, **kwargs):
        return [float(task.reward(examples[i], completion_text(c)).total) for i, c in zip(idx, completions)]

    tokenizer = load_tokenizer(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32, trust_remote_code=False)
    peft_config = LoraConfig(
        r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"],
        target_modules=list(cfg["lora_target_modules"]), bias="none", task_type="CAUSAL_LM",
    )

    begin: dict[int, float] = {}
    end: dict[int, float] = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begin[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            end[state.global_step] = time.perf_counter()

    trainer = GRPOTrainer(
        model=model, reward_funcs=task_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=peft_config, callbacks=[StepTimer()],
    )

    rollouts: list[dict[str, Any]] = []
    generate_s: list[float] = []
    group = cfg["group_size"]
    score = trainer._generate_and_score_completions
    generate = trainer._generate

    def timed_score(inputs):
        t0 = time.perf_counter()
        out = score(inputs)
        rollouts.append({
            "rollout_s": time.perf_counter() - t0,
            "completion_tokens": int(out["completion_mask"].sum().item()),
            "prompt_tokens": [int(x) for x in out["prompt_mask"].sum(1).tolist()[::group]],
        })
        return out

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        generate_s.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_score
    trainer._generate = timed_generate
    trainer.train()

    epochs = cfg["ppo_epochs"]
    steps = []
    for k, r in enumerate(rollouts):
        first, last = epochs * k + 1, epochs * (k + 1)
        if first not in begin or last not in end:
            break
        step_s = end[last] - begin[first]
        steps.append({
            "step_s": step_s, "rollout_s": r["rollout_s"], "update_s": step_s - r["rollout_s"],
            "generate_s": generate_s[k] if k < len(generate_s) else None,
            "completion_tokens": r["completion_tokens"], "prompt_tokens": r["prompt_tokens"],
        })
    n_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n)
    return {
        "side": "trl", "steps": steps, "n_params": n_params, "global_steps": trainer.state.global_step,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gradient_checkpointing": bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmrl.bench_trl", description="The TRL side of `llmrl bench`.")
    parser.add_argument("--config_json", required=True, help="JSON object of TrainConfig fields (model: a local directory)")
    parser.add_argument("--output_dir", required=True, help="TRL's output directory (nothing is saved there)")
    args = parser.parse_args(argv)
    result = run_trl(json.loads(args.config_json), args.output_dir)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
