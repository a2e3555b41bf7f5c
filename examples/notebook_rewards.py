# %% [markdown]
# # Reward functions from a notebook
#
# TRL's way: a reward function is a plain Python function `f(prompts, completions, **columns) -> list[float | None]`,
# given to the trainer as itself. llmrl takes it the same way (`reward_funcs=[...]`), beside the ready-made ones in
# `llmrl.rewards`. Run the cells in a notebook, or the whole file:
#
#     python examples/notebook_rewards.py [OUTPUT_DIR]       # 2 steps on the embedded smollm2-135m-instruct, CPU

# %%
import json
import sys
from pathlib import Path

import llmrl
from llmrl.errors import ConfigError

out = Path(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "runs/notebook-rewards")
out.mkdir(parents=True, exist_ok=True)

# %% A tiny dataset, built in Python: a prompt column and an answer column (every column reaches the reward functions)
rows = [{"prompt": f"What is {a} plus {b}? Answer with the number only.", "answer": str(a + b)}
        for a, b in [(2, 3), (4, 4), (7, 1), (6, 3), (5, 5), (9, 2), (8, 6), (3, 3)]]
data = out / "sums.jsonl"
data.write_text("".join(json.dumps(r) + "\n" for r in rows))
base = {"model": "smollm2-135m-instruct", "dataset": str(data), "eval_holdout": 1}


# %% A reward function defined here: one value per completion (None: not scored)
def mentions_answer(prompts, completions, answer, **kwargs):
    """1.0 when the completion contains the row's answer, else 0.0."""
    return [float(a in c) for c, a in zip(completions, answer)]


# DAPO's length penalty, here in characters: 0 up to 60, falling to -1 at 100
short = llmrl.rewards.soft_overlong_punishment(max_length=100, cache=40)

# %% A function with another signature is refused at start, in one line, before the model loads
def correct(completion, answer):
    return float(answer in completion)


try:
    llmrl.train(llmrl.load_config(None, base | {"reward_funcs": [correct], "output_dir": str(out / "refused")}))
except ConfigError as e:
    print("refused:", e)

# %% Train 2 steps with both functions (weights 1 and 0.5), on CPU-sized shapes
cfg = llmrl.load_config(None, base | {
    "system_prompt": "none",
    "reward_funcs": [mentions_answer, short], "reward_weights": [1.0, 0.5],
    "steps": 2, "batch_size": 2, "group_size": 4, "minibatch_size": 8, "max_new_tokens": 24, "max_prompt_tokens": 64,
    "lr": 2e-4, "warmup_steps": 0, "eval_interval": 2, "eval_n": 2, "save_interval": 2,
    "output_dir": str(out / "run")})
result = llmrl.train(cfg, overwrite=True)

# %% Each function's mean is logged as reward/<its name>; config.yaml names a notebook's function by a marker
print({k: v for k, v in result.last_metrics.items() if k.startswith("reward/")})
print((out / "run" / "config.yaml").read_text().split("reward_funcs:")[1].split("reward_weights")[0].strip())
