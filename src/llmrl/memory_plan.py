"""`llmrl train --dry_run`: the memory a config needs per rank, from the model's config alone (no weights load).

    parameters   the policy's weights on this rank: the base in its dtype (fp32 for full weights: master weights),
                 LoRA's adapters in fp32; with shard fsdp 1/N of each
    gradients    fp32, of what trains (the adapters, or every weight), 1/N with fsdp
    optimizer    AdamW's two fp32 moments of what trains, 1/N with fsdp
    reference    full weights with kl_coef > 0: a frozen fp32 copy of the base (1/N with fsdp); LoRA: none (the
                 adapter switched off)
    gathered     shard fsdp: generation and scoring run on the whole model, gathered (policy, and the reference)
    checkpoint   shard fsdp with LoRA, rank 0: a checkpoint gathers the adapter and its AdamW state to its CPU
                 memory (counted on device cpu; full weights write their shards where they are, DCP)
    activations  the largest training forward: token_budget padded tokens at most (rows × (prompt + completion)),
                 the tensors autograd keeps per token and layer (counted below for a Llama/Qwen block), and the
                 completion positions' logits three times (logits, log-softmax, their gradient)
    runtime      this process's resident memory before the model loads (Python, torch, transformers), measured

The peak is the state plus the largest of the update's activations, generation's gathered weights and rank 0's
checkpoint gather, plus runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: parameter count (tied weights once), the LoRA parameters for the targets, and
    a block's sizes."""

    params: int
    lora_params: int
    layers: int
    hidden: int
    kv_dim: int  # key/value heads × head dim
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    gradients: int
    optimizer: int
    reference: int
    gathered: int
    checkpoint: int
    activations: int
    runtime: int

    @property
    def peak(self) -> int:
        state = self.parameters + self.gradients + self.optimizer + self.reference
        return state + max(self.activations, self.gathered, self.checkpoint) + self.runtime

    def lines(self) -> list[str]:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer (AdamW)", self.optimizer),
                ("reference copy", self.reference), ("gathered for generation", self.gathered),
                ("checkpoint gather (rank 0)", self.checkpoint),
                ("activations (peak forward)", self.activations), ("runtime (measured)", self.runtime),
                ("peak", self.peak)]
        return [f"  {name:<28}{value / GiB:9.3f} GiB" for name, value in rows]


def model_shape(config, lora_targets: list[str], lora_r: int) -> Shape:
    """The Shape of a transformers config, by building the model on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied weights once
    lora = sum(lora_r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets)
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    return Shape(params, lora, text.num_hidden_layers, text.hidden_size, kv * head_dim, text.intermediate_size,
                 text.vocab_size)


def activation_bytes(s: Shape, tokens: int, logit_tokens: int, checkpointing: bool, act_bytes: int) -> int:
    """Autograd's saved tensors of one training forward of `tokens` tokens, `logit_tokens` of them scored.

    Per token and block (Llama/Qwen): the two norms' inputs (2h), the attention projections' shared input (h),
    q and k before rotary (h + kv), SDPA's q, k, v and output (2h + 2kv), the MLP's input (h), gate, SiLU(gate) and
    up (3i), the down projection's input (i): 7h + 3kv + 4i. With gradient checkpointing only each block's input
    (h) is kept, plus one block's tensors during its recomputation. Logits (fp32): kept, log-softmaxed, and their
    gradient: 3 × logit_tokens × vocab."""
    per_block = 7 * s.hidden + 3 * s.kv_dim + 4 * s.intermediate
    kept = (s.layers * s.hidden + per_block) if checkpointing else s.layers * per_block
    return tokens * kept * act_bytes + 3 * logit_tokens * s.vocab * 4


def plan_memory(s: Shape, *, full: bool, world: int, fsdp: bool, base_bytes: int, kl: bool, tokens: int,
                logit_tokens: int, checkpointing: bool, act_bytes: int, runtime: int, cpu: bool = True) -> MemoryPlan:
    """Bytes per rank (see the module docstring); `world` ranks, sharded with `fsdp`."""
    share = world if fsdp else 1
    trained = s.params if full else s.lora_params
    weights = s.params * 4 if full else s.params * base_bytes + s.lora_params * 4
    reference = s.params * 4 if full and kl else 0
    gathered = (weights + reference) - (weights + reference) // share if fsdp else 0  # the rest of the whole model
    checkpoint = trained * 12 if fsdp and cpu and not full else 0  # the adapter's fp32 weights and AdamW moments
    return MemoryPlan(parameters=weights // share, gradients=trained * 4 // share, optimizer=trained * 8 // share,
                      reference=reference // share, gathered=gathered, checkpoint=checkpoint,
                      activations=activation_bytes(s, tokens, logit_tokens, checkpointing, act_bytes), runtime=runtime)


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def longest_prompt(cfg) -> tuple[int, str]:
    """(prompt tokens to plan for, where the figure comes from): the longest of 256 of the task's training prompts in
    the chat template, capped at max_prompt_tokens; max_prompt_tokens itself where the task cannot say."""
    from llmrl.chat_templates import use_chat_template
    from llmrl.models.loading import load_tokenizer, resolve_model_path
    from llmrl.tasks import task_from_config

    try:
        tokenizer = load_tokenizer(resolve_model_path(cfg.model))
        use_chat_template(tokenizer, cfg.chat_template)
        examples = task_from_config(cfg).sample_train_batch(256)
        longest = max(len(tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]) for ex in examples)
    except Exception:  # noqa: BLE001 - an environment, or data not here: plan for the cap
        return cfg.max_prompt_tokens, "max_prompt_tokens"
    return min(longest, cfg.max_prompt_tokens), "the longest of 256 training prompts"


def dry_run(cfg, world: int) -> list[str]:
    """The plan of a config on `world` ranks, as printed lines."""
    from transformers import AutoConfig

    from llmrl.config import resolve
    from llmrl.models.loading import resolve_model_path

    plan = resolve(cfg)
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model))
    shape = model_shape(config, cfg.lora_target_modules, cfg.lora_r)
    full, fsdp = cfg.finetune == "full", cfg.shard == "fsdp" and world > 1
    prompt, source = longest_prompt(cfg)
    # the largest training forward: a window's rows with fuse_accumulation, else a minibatch's, on this rank; with
    # the shared prefix each prompt runs once for its group's completions
    rows = max(1, cfg.minibatch_size * (cfg.grad_accum_steps if plan.fuse_accumulation else 1) // world)
    prompts = -(-rows // cfg.group_size) if plan.shared_prefix_update else rows
    tokens = min(plan.token_budget, prompts * prompt + rows * cfg.max_new_tokens)
    logit_tokens = min(tokens, rows * cfg.max_new_tokens)
    base_bytes = 2 if str(plan.dtype) == "torch.bfloat16" else 4
    act_bytes = 2 if plan.autocast is not None or str(plan.dtype) == "torch.bfloat16" else 4
    runtime = resident_bytes()
    m = plan_memory(shape, full=full, world=world, fsdp=fsdp, base_bytes=base_bytes, kl=cfg.kl_coef > 0, tokens=tokens,
                    logit_tokens=logit_tokens, checkpointing=cfg.gradient_checkpointing, act_bytes=act_bytes,
                    runtime=runtime, cpu=plan.device.type == "cpu")
    lora = "" if full else f" (LoRA r {cfg.lora_r}: {shape.lora_params / 1e6:.2f}M trained)"
    return [f"llmrl: memory plan per rank (--dry_run: nothing trains): {cfg.model}, {shape.params / 1e6:.1f}M "
            f"parameters, finetune {cfg.finetune}{lora}, {world} rank(s), shard {'fsdp' if fsdp else 'ddp'}, "
            f"{plan.device.type}; largest training forward {tokens} tokens ({rows} rows of ≤ {prompt} prompt tokens "
            f"({source}) + ≤ {cfg.max_new_tokens} completion tokens)", *m.lines()]
