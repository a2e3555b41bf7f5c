"""llmrl: reinforcement learning with verifiable rewards for LLMs (GRPO, GR-REINFORCE) on LoRA adapters.

    from llmrl import load_config, train, evaluate
    cfg = load_config("configs/quickstart.yaml", {"steps": 10, "output_dir": "runs/api"})
    result = train(cfg)                      # TrainResult: model, tokenizer, run_dir, last_metrics, adapter
    metrics, rows = evaluate(cfg, result.model, result.tokenizer)

A reward function may be given as itself (TRL's signature; llmrl.rewards holds common ones):

    cfg = load_config(None, {"dataset": "rows.jsonl", "reward_funcs": [my_reward, llmrl.rewards.accuracy]})

Names are imported on first use, so `import llmrl` stays light (no torch until needed).
"""

__version__ = "0.1.0"

_EXPORTS = {
    "TrainConfig": "llmrl.config", "load_config": "llmrl.config",
    "train": "llmrl.training.loop", "TrainResult": "llmrl.training.loop",
    "Example": "llmrl.tasks", "Reward": "llmrl.tasks", "Task": "llmrl.tasks", "TASKS": "llmrl.tasks",
    "register_reward": "llmrl.tasks", "make_task": "llmrl.tasks", "register_env": "llmrl.tasks",
    "Environment": "llmrl.tasks", "Episode": "llmrl.tasks", "Turn": "llmrl.tasks",
    "rewards": "llmrl.rewards",  # a module: reward functions with TRL's signature
}


def evaluate(cfg, model, tokenizer, task=None):
    """Eval of `model` as `llmrl eval` does it (greedy, or cfg.eval_samples_per_prompt samples):
    (metrics named eval/…, one row per completion). The task defaults to the config's."""
    from llmrl.tasks import task_from_config
    from llmrl.training.run import eval_policy

    return eval_policy(cfg, model, tokenizer, task if task is not None else task_from_config(cfg))


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(_EXPORTS[name])
        return module if _EXPORTS[name] == f"{__name__}.{name}" else getattr(module, name)
    raise AttributeError(f"module 'llmrl' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_EXPORTS})


__all__ = ["__version__", "evaluate", *_EXPORTS]
