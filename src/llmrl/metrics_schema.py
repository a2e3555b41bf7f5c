"""Every key llmrl writes to a run's metrics.jsonl, in one place: what it is, its kind, and when it is there.

    describe("train/kl")           → Metric(kind="mean", when="every step", text=...)
    describe("reward/my_part")     → the pattern of a custom task's reward components
    describe("nope/x")             → None

`METRICS` holds the exact keys (llmrl's own, and the built-in tasks' reward components, counts and eval
metrics), `PATTERNS` the families whose names come from a config value or a user's task. Data only, read from
the code that builds the records (training/step.py, training/update.py, rollout/episodes.py,
training/evaluate.py, training/run.py, training/loop.py, tasks/*.py): docs/metrics.md is generated from it
(`make docs`, llmrl.docs_gen), and tests/test_docs.py fails when a run logs a key that `describe` does not
know, or when an exact key here is no longer written anywhere.

A record is one RL step (`step`, reward/, adv/, train/, rollout/, time/ keys, `warnings`) or one eval
(`step`, eval/ keys, time/eval_s). Only rank 0 writes; means and counts cover every rank's completions.
NaN and infinities are written as null. wandb and TensorBoard get the same names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS: dict[str, str] = {
    "value": "a value of this record (a step number, a setting as it was this step)",
    "list": "a JSON list",
    "mean": "a mean over this step's completions, tokens, episodes or minibatches (the text says which)",
    "std": "a standard deviation (population) over this step's completions",
    "min": "the smallest over this step's completions",
    "max": "the largest over this step's completions, tokens, episodes or rows (or over ranks)",
    "fraction": "a share from 0 to 1",
    "count": "a number of things this step (or this eval), over every rank",
    "total so far": "a count (or seconds) since the run started, carried across --resume",
    "seconds": "wall-clock seconds of this step (or this eval) on rank 0",
    "mean or count": "a mean per completion for a reward component, a sum over the step for a count",
}


@dataclass(frozen=True)
class Metric:
    """One key (or family of keys) of metrics.jsonl."""

    kind: str  # a KINDS key
    when: str  # when the key is in a record: "every step", "eval", or the config / task that adds it
    text: str  # one sentence: what it is, its unit


EVERY_STEP = "every step"
EVAL = "eval"
ENVIRONMENTS = "environments"  # a multi-turn task (tasks/env.py: Environment), e.g. --task calculator or guess
VLLM = "vllm engines"  # rollout_engine vllm or vllm-server: the engine returns its own log-probs
ASYNC = "async"  # max_staleness >= 1
DYNAMIC = "dynamic_sampling"


def task(*names: str) -> str:
    return "task " + ", ".join(names)


METRICS: dict[str, Metric] = {
    # --- every record
    "step": Metric("value", "every record", "The RL step the record belongs to (1..steps); an eval record carries "
                   "the step it followed, 0 for the eval of the untrained policy before step 1."),
    "warnings": Metric("list", "a health check fired", "The health warnings this step raised, one line each "
                       "(truncation, no reward spread, constant reward, train/kl over health_max_kl, train/clip_frac "
                       "over health_max_clip_frac: training/health.py; once per run, on a step or an eval record, a "
                       "dataset grader that found no answer in most completions); absent when there are none."),
    # --- reward/: llmrl's own
    "reward/mean": Metric("mean", EVERY_STEP, "Mean reward of the step's completions (the task's reward plus the "
                          "shaping terms reward/overlong and reward/kl_penalty), the advantages' input."),
    "reward/std": Metric("std", EVERY_STEP, "Standard deviation (population) of the same rewards."),
    "reward/min": Metric("min", EVERY_STEP, "Smallest reward of the step."),
    "reward/max": Metric("max", EVERY_STEP, "Largest reward of the step."),
    "reward/errors": Metric("total so far", EVERY_STEP, "Completions (or episodes) whose reward function raised, "
                            "overran user_code_timeout or was not a finite number, each scored 0, since the run "
                            "started (--strict_rewards stops the run instead)."),
    "reward/timeouts": Metric("count", "a reward call into user code overran", "Of reward/errors, this step's "
                              "completions (or episodes) whose reward call into user code (a task's or environment's "
                              "reward, a reward function, an environment_factory's get_reward) overran "
                              "user_code_timeout and was killed or abandoned, each scored 0; absent when none."),
    "reward/overlong": Metric("mean", "overlong_buffer > 0", "DAPO's soft overlong penalty per completion (0 down to "
                              "-overlong_penalty over the last overlong_buffer tokens of the token budget: "
                              "max_new_tokens, or episode_tokens for an environment), added to the reward."),
    "reward/kl_penalty": Metric("mean", "kl_in_reward", "The KL penalty moved into the reward, -kl_coef times the "
                                "sum over the completion's tokens of the per-token KL (kl_estimator) to the "
                                "reference policy."),
    # --- reward/: the built-in tasks' components (mean per completion) and counts (summed over the step)
    "reward/has_tag": Metric("mean", task("format_copy"), "0.2 when the completion holds an <answer>...</answer> tag."),
    "reward/strict": Metric("mean", task("format_copy"), "0.1 when the whole completion is that one answer tag."),
    "reward/exact": Metric("mean", task("format_copy"), "1.0 when the first answer tag holds the target integer."),
    "reward/boxed": Metric("mean", task("math_hard"), "0.1 for a boxed answer: the text contains \\boxed{ "
                           "(math_reward=seed), or math-verify extracted a boxed answer (math_reward=verify)."),
    "reward/boxed_exact": Metric("mean", task("math_hard") + " (math_reward=seed)", "1.0 when the last boxed answer "
                                 "is a number within 1e-6 of the gold."),
    "reward/relaxed": Metric("mean", task("math_hard") + " (math_reward=seed)", "0.1 when the boxed answer is no "
                             "number but the last number of the text equals the gold."),
    "reward/correct": Metric("mean", task("calculator", "math_hard (math_reward=verify)"), "1.0 for a right answer: "
                             "the product in the answer tag (calculator), or a boxed answer math-verify finds "
                             "equivalent to the gold (math_hard)."),
    "reward/tool": Metric("mean", task("calculator"), "0.1 when a calculator call of the episode returned the product "
                          "asked for."),
    "reward/solved": Metric("mean", task("guess"), "1.0 - 0.1 x (guesses - 1) when the number was found, else 0."),
    "reward/format": Metric("mean", task("guess"), "0.2 x the share of the episode's replies that are a valid guess."),
    "reward/reward": Metric("mean", "a reward function (--task file.py:fn --prompts FILE)", "The function's value "
                            "(0 where it returned None)."),
    "reward/unscored": Metric("count", "a reward function (--task file.py:fn --prompts FILE)", "Completions the "
                              "function returned None for (scored 0)."),
    "reward/grade_timeouts": Metric("count", task("math_hard") + " (math_reward=verify)", "Completions whose "
                                    "math-verify grading overran grade_time_limit (graded not correct)."),
    "reward/grade_errors": Metric("count", task("math_hard") + " (math_reward=verify)", "Completions whose "
                                  "math-verify grading failed with an error (graded not correct)."),
    # --- adv/
    "adv/mean": Metric("mean", EVERY_STEP, "Mean advantage of the step's completions (adv_estimator, "
                       "normalize_advantages, clamped to +-adv_clip)."),
    "adv/std": Metric("std", EVERY_STEP, "Standard deviation (population) of the advantages."),
    "adv/min": Metric("min", EVERY_STEP, "Smallest advantage."),
    "adv/max": Metric("max", EVERY_STEP, "Largest advantage."),
    # --- train/: the update (means over the update's minibatches, averaged over ranks)
    "train/loss": Metric("mean", EVERY_STEP, "The minimised loss, pg_loss + kl_coef x kl (kl_coef 0 with "
                         "kl_in_reward), mean over the update's minibatches."),
    "train/pg_loss": Metric("mean", EVERY_STEP, "The policy-gradient term of the loss (algo, loss_agg), mean over "
                            "the update's minibatches."),
    "train/kl": Metric("mean", EVERY_STEP, "The KL term to the reference policy (kl_estimator, kl_agg; per token "
                       "with token_mean), mean over the update's minibatches; 0 when kl_coef is 0 or with kl_in_reward."),
    "train/clip_frac": Metric("fraction", EVERY_STEP, "Share of completion tokens where the clipped term of the "
                              "PPO objective was chosen (clip_frac_low + clip_frac_high); 0 for algo reinforce."),
    "train/clip_frac_low": Metric("fraction", EVERY_STEP, "Share of completion tokens clipped below, ratio < "
                                  "1 - clip_eps_low with a negative advantage; 0 for algo reinforce."),
    "train/clip_frac_high": Metric("fraction", EVERY_STEP, "Share of completion tokens clipped above, ratio > "
                                   "1 + clip_eps_high with a positive advantage; 0 for algo reinforce."),
    "train/grad_norm": Metric("mean", EVERY_STEP, "Gradient norm before clipping at max_grad_norm, mean over the "
                              "optimizer steps taken; null when none was taken."),
    "train/state_mb": Metric("value", "when an optimizer step was taken", "MiB that rank 0 holds of the trained "
                             "parameters, their gradients and the AdamW state at its last optimizer step (local shards "
                             "with shard fsdp): the memory that sharding divides among the ranks."),
    "train/lr": Metric("value", EVERY_STEP, "The learning rate of this step (lr after warmup_steps' linear warmup)."),
    "train/entropy": Metric("mean", "unless old_logprobs=engine or async", "Mean token entropy (nats, temperature 1) "
                            "of the sampling policy over the step's completion tokens; absent when the old log-probs "
                            "are the vLLM engine's (it returns no entropies)."),
    "train/optimizer_steps": Metric("total so far", EVERY_STEP, "Optimizer steps taken since the run started."),
    "train/skipped_updates": Metric("total so far", EVERY_STEP, "Optimizer steps skipped for a non-finite loss or "
                                    "gradient norm, plus minibatches without completion tokens, since the run "
                                    "started (max_bad_steps non-finite ones in a row stop the run)."),
    "train/empty_minibatches": Metric("total so far", EVERY_STEP, "Minibatches without completion tokens (no "
                                      "forward, not accumulated) since the run started."),
    # --- rollout/: every step
    "rollout/zero_spread_frac": Metric("fraction", EVERY_STEP, "Share of the step's groups whose group_size rewards "
                                       "are all equal (they give no policy gradient)."),
    "rollout/completion_len": Metric("mean", EVERY_STEP, "Sampled tokens per completion, EOS included (an "
                                     "episode: all its replies, environment tokens excluded), before overlong_filter."),
    "rollout/completion_len_max": Metric("max", EVERY_STEP, "The longest completion's sampled tokens."),
    "rollout/truncated_frac": Metric("fraction", EVERY_STEP, "Share of completions whose (last) reply was cut by a "
                                     "token cap (max_new_tokens, or an environment's episode_tokens) instead of "
                                     "ending with EOS."),
    "rollout/prompts_truncated": Metric("count", EVERY_STEP, "Prompts longer than max_prompt_tokens, cut to their "
                                        "last max_prompt_tokens tokens (long_prompts=truncate)."),
    "rollout/prompts_skipped": Metric("total so far", EVERY_STEP, "Prompts longer than max_prompt_tokens that were "
                                      "redrawn (long_prompts=skip; 0 otherwise), since the run started."),
    "rollout/completions": Metric("total so far", EVERY_STEP, "Completions (episodes) sampled for training since the "
                                  "run started."),
    # --- rollout/: environments (per-episode means and counts over every episode sampled this step)
    "rollout/turns": Metric("mean", ENVIRONMENTS, "Policy replies per episode."),
    "rollout/turns_max": Metric("max", ENVIRONMENTS, "The most replies any episode of the step took."),
    "rollout/tool_calls": Metric("mean", ENVIRONMENTS, "Tool calls per episode (Turn.tool_calls)."),
    "rollout/tool_errors": Metric("mean", ENVIRONMENTS, "Failed tool calls per episode (Turn.tool_errors)."),
    "rollout/env_tokens": Metric("mean", ENVIRONMENTS, "Tokens the environment's turns added to the episode (not "
                                 "sampled, not scored), per episode."),
    "rollout/env_truncated": Metric("count", ENVIRONMENTS, "Environment messages cut or dropped by max_env_tokens."),
    "rollout/env_errors": Metric("count", ENVIRONMENTS, "Episodes ended by the environment raising, overrunning "
                                 "env_timeout or returning something that is not a Turn (each scored 0)."),
    "rollout/env_timeouts": Metric("count", ENVIRONMENTS, "Of rollout/env_errors, the episodes whose step overran "
                                   "env_timeout."),
    "rollout/env_abandoned": Metric("max", ENVIRONMENTS, "Overrunning environment steps still running on a rank's "
                                    "threads (env_isolation=thread; always 0 with process)."),
    "rollout/cut_max_turns": Metric("count", ENVIRONMENTS, "Episodes the environment would have continued after "
                                    "their max_turns-th reply."),
    "rollout/cut_episode_tokens": Metric("count", ENVIRONMENTS, "Episodes that used up their episode_tokens budget."),
    "rollout/cut_reply_tokens": Metric("count", ENVIRONMENTS, "Episodes whose last reply was cut at max_new_tokens "
                                       "with episode budget left."),
    # --- rollout/: dynamic sampling, async, vLLM
    "rollout/sampling_rounds": Metric("count", DYNAMIC, "Rounds of sampling the step took to find batch_size groups "
                                      "with a reward spread (at most dynamic_sampling_rounds)."),
    "rollout/groups_flat_dropped": Metric("count", DYNAMIC, "Groups with all-equal rewards set aside and not learned "
                                          "from."),
    "rollout/groups_flat_kept": Metric("count", DYNAMIC, "Groups with all-equal rewards that filled the batch after "
                                       "the last round."),
    "rollout/policy_lag": Metric("mean", ASYNC, "Policy versions between the rows' sampling policy and the policy "
                                 "learning from them, mean over the rows (0 at the first step after a start or "
                                 "resume, 1 after)."),
    "rollout/policy_lag_max": Metric("max", ASYNC, "The largest policy lag of the step's rows."),
    "rollout/engine_logprob_diff": Metric("mean", VLLM, "Mean |engine - trainer| log-prob of the sampled tokens at "
                                          "the sampling policy, over completion tokens (with old_logprobs=engine: "
                                          "against the first optimizer window's training forward)."),
    "rollout/engine_logprob_diff_max": Metric("max", VLLM, "The largest such |engine - trainer| log-prob gap."),
    "rollout/lagged_logprob_diff": Metric("mean", ASYNC + ", rows a version behind", "Mean |engine - trainer| "
                                          "log-prob of the sampled tokens when the rows are older than the learning "
                                          "policy: the policy's change since, plus the engine's mismatch."),
    "rollout/lagged_logprob_diff_max": Metric("max", ASYNC + ", rows a version behind", "The largest such gap."),
    # --- time/
    "time/rollout_s": Metric("seconds", EVERY_STEP, "Steps 1-3 of the step: prompts, sampling (async: waiting for "
                             "the draw), old and reference log-probs, rewards."),
    "time/generate_s": Metric("seconds", EVERY_STEP, "Of time/rollout_s, syncing the engine and sampling (async: the "
                              "draw made on a thread during the step before; dynamic_sampling: every round)."),
    "time/logprobs_s": Metric("seconds", EVERY_STEP, "Of time/rollout_s, the old (unless the engine's) and reference "
                              "log-prob forwards."),
    "time/update_s": Metric("seconds", EVERY_STEP, "The policy update (ppo_epochs x minibatches, optimizer steps)."),
    "time/train_s": Metric("total so far", EVERY_STEP, "Seconds of rollout and update (not eval, not checkpoints) "
                           "since the run started."),
    "time/eval_s": Metric("seconds", EVAL, "The eval's wall time: decoding, scoring and the task's metrics."),
    # --- eval/: llmrl's own
    "eval/reward": Metric("mean", EVAL, "Mean task reward of the eval completions (or episodes), no shaping terms."),
    "eval/reward_errors": Metric("count", EVAL, "Eval completions whose reward raised, overran "
                                 "user_code_timeout or was not a finite number (scored 0)."),
    "eval/truncated_frac": Metric("fraction", EVAL, "Share of eval completions cut at eval's token cap "
                                  "(eval_max_new_tokens; format_copy at most 24), or episodes whose last reply was cut."),
    "eval/turns": Metric("mean", EVAL + ", environments", "Policy replies per eval episode."),
    "eval/tool_calls": Metric("mean", EVAL + ", environments", "Tool calls per eval episode."),
    # --- eval/: the built-in tasks' evaluate()
    "eval/exact_match": Metric("fraction", EVAL + ", " + task("format_copy"), "Completions whose first answer tag "
                               "holds the target."),
    "eval/has_tag": Metric("fraction", EVAL + ", " + task("format_copy"), "Completions with an answer tag."),
    "eval/strict": Metric("fraction", EVAL + ", " + task("format_copy"), "Completions that are only the answer tag."),
    "eval/boxed_exact": Metric("fraction", EVAL + ", " + task("math_hard") + " (math_reward=seed)", "Completions "
                               "whose last boxed answer is the gold number."),
    "eval/relaxed_exact": Metric("fraction", EVAL + ", " + task("math_hard") + " (math_reward=seed)", "Completions "
                                 "whose boxed answer or last number is the gold."),
    "eval/boxed_rate": Metric("fraction", EVAL + ", " + task("math_hard"), "Completions with a closed \\boxed{...} "
                              "(math_reward=verify: one math-verify extracted)."),
    "eval/correct": Metric("fraction", EVAL + ", " + task("calculator", "math_hard (math_reward=verify)"), "Right "
                           "answers: the product in the answer tag (calculator), math-verify's verdict (math_hard)."),
    "eval/grade_timeouts": Metric("count", EVAL + ", " + task("math_hard") + " (math_reward=verify)", "Eval "
                                  "completions whose grading overran grade_time_limit."),
    "eval/answered": Metric("fraction", EVAL + ", " + task("calculator"), "Episodes that ended with an answer tag."),
    "eval/used_calc": Metric("fraction", EVAL + ", " + task("calculator"), "Episodes with at least one calculator "
                             "call."),
    "eval/solved": Metric("fraction", EVAL + ", " + task("guess"), "Games where the number was found."),
    "eval/valid": Metric("mean", EVAL + ", " + task("guess"), "Share of an episode's replies that are a valid guess, "
                         "mean over episodes."),
    "eval/scored": Metric("fraction", EVAL + ", a reward function", "Completions the function scored (not None, "
                          "did not raise)."),
}


def _p(regex: str) -> re.Pattern[str]:
    return re.compile(regex)


PATTERNS: list[tuple[re.Pattern[str], Metric]] = [
    (_p(r"eval/pass@(?P<j>\d+)"), Metric("fraction", EVAL + ", eval_samples_per_prompt = k > 1", "Unbiased pass@j "
     "for j = 1, 2, 4, ... below k, and k: the chance that j samples drawn from a prompt's k hold a correct one (the "
     "task's judge, a \"correct\" reward component, or an environment's correct(episode)), mean over prompts.")),
    (_p(r"eval/maj@(?P<k>\d+)"), Metric("fraction", EVAL + ", eval_samples_per_prompt = k > 1, a task with judge",
     "Prompts whose most common answer among the k samples is correct (single-turn tasks that compare answers: "
     "format_copy, math_hard).")),
    (_p(r"eval/(?P<metric>.+)"), Metric("value", EVAL + ", a custom task", "What the task's evaluate() returns, "
     "under eval/ (a custom environment's default evaluate: the mean per episode of each Turn.parts name).")),
    (_p(r"reward/(?P<name>.+)"), Metric("mean or count", "a custom task", "The task's reward components "
     "(Reward.components: mean per completion), counts (Reward.counts: summed over the step) and metrics "
     "(Reward.metrics, never in the total: mean over the completions that report it), by their names; with "
     "--reward_funcs, each function's values under its name.")),
]

CUSTOM_EVAL, CUSTOM_REWARD = PATTERNS[-2][1], PATTERNS[-1][1]  # what any name a user's task picks falls under


def describe(key: str) -> Metric | None:
    """The metric `key` of a metrics.jsonl record is: its exact entry, else the first pattern it matches in full."""
    if key in METRICS:
        return METRICS[key]
    return next((m for regex, m in PATTERNS if regex.fullmatch(key)), None)


def shown(regex: re.Pattern[str]) -> str:
    """A pattern as the docs write it: each named group as <name> (`eval/pass@(?P<j>\\d+)` → `eval/pass@<j>`)."""
    return re.sub(r"\(\?P<(\w+)>[^)]*\)", r"<\1>", regex.pattern)
