"""llmrl from Python: a reward function, a short GRPO run and an eval (the README's API example).

    python examples/api_example.py [MODEL]        # default: the embedded smollm2-135m-instruct
"""

import sys
from pathlib import Path

from llmrl import evaluate, load_config, register_reward, train


def brevity(prompt: str, completion: str, **meta) -> float:
    return max(0.0, 1 - len(completion.split()) / 20)  # shorter answers score higher


register_reward("brevity", brevity, prompts=str(Path(__file__).with_name("brevity_prompts.jsonl")))
cfg = load_config(None, {"model": sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct", "task": "brevity",
                         "steps": 2, "batch_size": 2, "group_size": 4, "minibatch_size": 8, "max_new_tokens": 16,
                         "lr": 2e-4, "warmup_steps": 0, "eval_n": 4, "output_dir": "runs/api-example"})
result = train(cfg, overwrite=True)
metrics, rows = evaluate(cfg, result.model, result.tokenizer)
print(result.adapter, metrics["eval/reward"])
