"""llmrl: reinforcement learning with verifiable rewards for LLMs (GRPO, GR-REINFORCE) on LoRA adapters."""

__version__ = "0.1.0"
