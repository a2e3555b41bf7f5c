"""The README's memory table: peak GiB per GPU that `llmrl train --dry_run` plans for Qwen2.5 0.5B/1.5B/7B/32B with the
course's math_hard GRPO shapes (configs/math_hard_grpo.yaml: minibatch 8 completions, prompts and completions of up to
512 tokens each, gradient checkpointing, kl_coef 0.05), bf16 on the GPU, on 1, 8 and 16 GPUs.

    python benchmarks/memory_table.py

The shapes are the published config.json values of the Qwen2.5 models (no download: the hub is not reachable here);
the plan is the same function --dry_run uses (llmrl.memory_plan.plan_memory), without the CUDA context and
allocator slack (the runtime line, measured on CPU, has no GPU counterpart here)."""

from transformers import Qwen2Config

from llmrl.config import LORA_TARGETS
from llmrl.memory_plan import GiB, model_shape, plan_memory

QWEN25 = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings (the models' config.json)
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
    "32B": (5120, 27648, 64, 40, 8, 152064, False),
}


def peak(shape, full: bool, gpus: int, fsdp: bool) -> float:
    rows = max(1, 8 // gpus)  # the minibatch's 8 completions shared among the ranks
    tokens = min(8192, rows * (512 + 512))
    m = plan_memory(shape, full=full, world=gpus, fsdp=fsdp, base_bytes=2, kl=True, tokens=tokens,
                    logit_tokens=rows * 512, checkpointing=True, act_bytes=2, runtime=0, cpu=False)
    return m.peak / GiB


def main() -> None:
    print("| model | LoRA, 1 GPU | LoRA FSDP2, 8 | full, 1 GPU | full FSDP2, 8 | full FSDP2, 16 |")
    print("|---|---|---|---|---|---|")
    for name, (h, i, layers, heads, kv, vocab, tied) in QWEN25.items():
        config = Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied)
        s = model_shape(config, list(LORA_TARGETS), 16)
        cells = [peak(s, False, 1, False), peak(s, False, 8, True), peak(s, True, 1, False), peak(s, True, 8, True),
                 peak(s, True, 16, True)]
        print(f"| Qwen2.5-{name} ({s.params / 1e9:.2f}B) | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
