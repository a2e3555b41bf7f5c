"""`llmrl train --dry_run`: the memory a config needs per rank, from the model's config alone (no weights load).

    parameters   the policy's weights on this rank: the base in its dtype (fp32 for full weights: master weights),
                 LoRA's adapters in fp32; with shard fsdp 1/N of each
    gradients    fp32, of what trains (the adapters, or every weight), 1/N with fsdp
    optimizer    AdamW's two fp32 moments of what trains, 1/N with fsdp
    reference    full weights with kl_coef > 0: a frozen fp32 copy of the base (1/N with fsdp); LoRA: none (the
                 adapter switched off)
    packs        LoRA on CPU where the run packs its frozen linears for oneDNN (measured to pay, as the run measures
                 it) or multiplies them in bf16: W and W.T packed, fp32 (8 bytes per weight) or bf16 (4)
    merged       LoRA merged while sampling (merge_lora_sampling, fp32 products): a merged copy of each adapted
                 weight, and its oneDNN pack where the frozen linears are packed
    gathered     shard fsdp: generation and scoring run on the whole model, gathered (policy, and the reference):
                 whole unsharded copies beside the rank's own shards, which FSDP2 keeps; no gradients are held
                 then (they are freed after each optimizer step)
    update gather  shard fsdp, during the update: the root's own parameters (embeddings, LM head, final norm: not
                 in a block) unsharded from its forward to its backward, their whole gradient before the
                 reduce-scatter, and two blocks' unsharded parameters and gradients (the one running and the one
                 prefetched)
    checkpoint   shard fsdp with LoRA, rank 0: a checkpoint gathers the adapter and its AdamW state to its CPU
                 memory (counted on device cpu; full weights write their shards where they are, DCP)
    activations  the largest training forward: token_budget padded tokens at most (rows × (prompt + completion)),
                 the tensors autograd keeps per token and layer (counted below for a Llama/Qwen block; LoRA adds each
                 adapted layer's dropped-out input and its mask where lora_dropout > 0, and its A product), and the
                 completion positions' logits three times (logits, log-softmax, their gradient)
    runtime      this process's resident memory before the model loads (Python, torch, transformers), measured

The peak is the runtime plus the largest of three phases: the update (the state, its activations and its FSDP2
gathers), generation and scoring (the state without gradients, plus the gathered weights or LoRA's merged copies),
and a checkpoint (the state plus rank 0's gather). The state is the parameters, gradients, AdamW state, reference
and packs.
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
    block_params: int  # one transformer block's (the model's _no_split_modules class)
    layers: int
    hidden: int
    kv_dim: int  # key/value heads × head dim
    intermediate: int
    vocab: int
    linear_params: int = 0  # the weights of every nn.Linear (the LM head's once when tied): what packs copy
    target_params: int = 0  # the weights of the LoRA target linears: what merging copies
    target_inputs: int = 0  # the LoRA target linears' in_features summed over one block (per token and layer)
    targets_per_block: int = 0
    linear_shape: tuple = ()  # the [out, in] holding the most linear weights (the run measures packing on it)


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
    update_gather: int = 0
    packs: int = 0
    merged: int = 0

    @property
    def peak(self) -> int:
        state = self.parameters + self.gradients + self.optimizer + self.reference + self.packs
        update = state + self.activations + self.update_gather
        generation = state - self.gradients + self.gathered + self.merged
        return max(update, generation, state + self.checkpoint) + self.runtime

    def lines(self) -> list[str]:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer (AdamW)", self.optimizer),
                ("reference copy", self.reference), ("oneDNN/bf16 packs", self.packs),
                ("gathered for generation", self.gathered), ("LoRA merged for sampling", self.merged),
                ("checkpoint gather (rank 0)", self.checkpoint),
                ("activations (peak forward)", self.activations), ("update's FSDP2 gathers", self.update_gather),
                ("runtime (measured)", self.runtime),
                ("peak", self.peak)]
        return [f"  {name:<28}{value / GiB:9.3f} GiB" for name, value in rows]


def model_shape(config, lora_targets: list[str], lora_r: int) -> Shape:
    """The Shape of a transformers config, by building the model on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    params = sum(p.numel() for p in model.parameters())  # tied weights once
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    block = next((m for m in model.modules() if type(m).__name__ in blocks), None)
    lora = sum(lora_r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets)
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    block_params = sum(p.numel() for p in block.parameters()) if block is not None else 0
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    unique = {id(m.weight): m.weight for _, m in linears}  # a tied LM head is the embedding's tensor
    by_shape: dict[tuple, int] = {}
    for w in unique.values():
        by_shape[tuple(w.shape)] = by_shape.get(tuple(w.shape), 0) + w.numel()
    targets = [m for name, m in linears if name.rsplit(".", 1)[-1] in lora_targets]
    in_block = [m for m in (block.modules() if block is not None else []) if isinstance(m, torch.nn.Linear)
                and any(m is t for t in targets)]
    return Shape(params, lora, block_params, text.num_hidden_layers, text.hidden_size, kv * head_dim,
                 text.intermediate_size, text.vocab_size, linear_params=sum(w.numel() for w in unique.values()),
                 target_params=sum(m.weight.numel() for m in targets),
                 target_inputs=sum(m.in_features for m in in_block), targets_per_block=len(in_block),
                 linear_shape=max(by_shape, key=by_shape.get) if by_shape else ())


def activation_bytes(s: Shape, tokens: int, logit_tokens: int, checkpointing: bool, act_bytes: int,
                     lora: tuple[int, bool] | None = None) -> int:
    """Autograd's saved tensors of one training forward of `tokens` tokens, `logit_tokens` of them scored.

    Per token and block (Llama/Qwen): the two norms' inputs (2h), the attention projections' shared input (h),
    q and k before rotary (h + kv), SDPA's q, k, v and output (2h + 2kv), the MLP's input (h), gate, SiLU(gate) and
    up (3i), the down projection's input (i): 7h + 3kv + 4i. With gradient checkpointing only each block's input
    (h) is kept, plus one block's tensors during its recomputation. Logits (fp32): kept, log-softmaxed, and their
    gradient: 3 × logit_tokens × vocab.

    `lora` (r, dropout): each adapted linear also keeps its A product (r) and, with dropout, its dropped-out input
    (a copy of the layer's input) and the mask (a byte each): per block r × targets, + (act_bytes + 1) × the
    targets' inputs."""
    per_block = (7 * s.hidden + 3 * s.kv_dim + 4 * s.intermediate) * act_bytes
    if lora is not None:
        r, dropout = lora
        per_block += r * s.targets_per_block * act_bytes + (s.target_inputs * (act_bytes + 1) if dropout else 0)
    kept = (s.layers * s.hidden * act_bytes + per_block) if checkpointing else s.layers * per_block
    return tokens * kept + 3 * logit_tokens * s.vocab * 4


PACK_BYTES = {"none": 0, "fp32": 8, "bf16": 4, "bf16-copies": 2}  # per frozen linear weight: W and W.T packs


def plan_memory(s: Shape, *, full: bool, world: int, fsdp: bool, base_bytes: int, kl: bool, tokens: int,
                logit_tokens: int, checkpointing: bool, act_bytes: int, runtime: int, cpu: bool = True,
                packs: str = "none", merge: bool = False, lora: tuple[int, bool] | None = None) -> MemoryPlan:
    """Bytes per rank (see the module docstring); `world` ranks, sharded with `fsdp`. LoRA's speed paths: `packs`
    (none, fp32 or bf16 oneDNN packs, or bf16-copies without oneDNN), `merge` (merged while sampling), `lora`
    (r, dropout > 0) for its activations."""
    share = world if fsdp else 1
    trained = s.params if full else s.lora_params
    weights = s.params * 4 if full else s.params * base_bytes + s.lora_params * 4
    reference = s.params * 4 if full and kl else 0
    gathered = weights + reference if fsdp else 0  # whole copies, beside the shards
    checkpoint = trained * 12 if fsdp and cpu and not full else 0  # the adapter's fp32 weights and AdamW moments
    update_gather = 0
    if fsdp:  # the root's own parameters and two blocks', unsharded, with their gradients where they train
        root = s.params - s.layers * s.block_params
        per_param = 4 + 4 if full else base_bytes
        update_gather = (root + 2 * s.block_params) * per_param
    return MemoryPlan(parameters=weights // share, gradients=trained * 4 // share, optimizer=trained * 8 // share,
                      reference=reference // share, gathered=gathered, checkpoint=checkpoint,
                      activations=activation_bytes(s, tokens, logit_tokens, checkpointing, act_bytes,
                                                   None if full else lora),
                      runtime=runtime, update_gather=update_gather, packs=s.linear_params * PACK_BYTES[packs],
                      merged=s.target_params * (4 + (4 if packs == "fp32" else 0)) if merge else 0)


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


def planned_packs(plan, shape: Shape, fsdp: bool) -> str:
    """The packs a LoRA run on CPU makes of its frozen linears (training/run.py:build_policy decides the same way):
    bf16 (oneDNN) or bf16-copies with bf16 products, fp32 where oneDNN packing is measured to pay (the
    measurement is made now where this machine has none cached), none where they would take over half the free
    memory, with full weights or shard fsdp, or off CPU."""
    import torch

    from llmrl.models.packed_linear import (available_memory_bytes, onednn_available, onednn_bf16_available,
                                            packing_verdict, packs_fit)

    if plan.full or fsdp or plan.device.type != "cpu" or not shape.linear_params or plan.dtype != torch.float32:
        return "none"
    if plan.bf16_matmul:
        kind = "bf16" if onednn_bf16_available() else "bf16-copies"
    elif plan.onednn_linear and onednn_available():
        kind = "fp32" if not plan.measure_kernels or packing_verdict(shape.linear_shape)["pays"] else "none"
    else:
        return "none"
    free = available_memory_bytes()  # the run packs only where that takes at most half the free memory
    return kind if packs_fit(shape.linear_params * 4, kind.startswith("bf16"), None if free is None else free // 2) else "none"


def dry_run(cfg, world: int) -> list[str]:
    """The plan of a config on `world` ranks, as printed lines."""
    from transformers import AutoConfig

    from llmrl.config import resolve
    from llmrl.models.loading import resolve_model_path

    plan = resolve(cfg)
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model), trust_remote_code=False)
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
    packs = planned_packs(plan, shape, fsdp)
    m = plan_memory(shape, full=full, world=world, fsdp=fsdp, base_bytes=base_bytes, kl=cfg.kl_coef > 0, tokens=tokens,
                    logit_tokens=logit_tokens, checkpointing=cfg.gradient_checkpointing, act_bytes=act_bytes,
                    runtime=runtime, cpu=plan.device.type == "cpu", packs=packs, merge=plan.merge_lora and not fsdp,
                    lora=(cfg.lora_r, cfg.lora_dropout > 0))
    lora = "" if full else f" (LoRA r {cfg.lora_r}: {shape.lora_params / 1e6:.2f}M trained)"
    return [f"llmrl: memory plan per rank (--dry_run: nothing trains): {cfg.model}, {shape.params / 1e6:.1f}M "
            f"parameters, finetune {cfg.finetune}{lora}, {world} rank(s), shard {'fsdp' if fsdp else 'ddp'}, "
            f"{plan.device.type}; largest training forward {tokens} tokens ({rows} rows of ≤ {prompt} prompt tokens "
            f"({source}) + ≤ {cfg.max_new_tokens} completion tokens)", *m.lines()]
