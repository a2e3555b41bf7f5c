import os
import sys
from pathlib import Path

import pytest

# The suite's hand-worked numbers and tolerances are fp32: dtype=auto must not switch to bf16 on a CPU with
# a bf16 unit (this process and the llmrl subprocesses it starts). bf16 tests ask for it by name.
os.environ.setdefault("LLMRL_CPU_DTYPE", "float32")
# ... and they run on the CPU, also on a GPU host (device=auto would pick CUDA and bf16, where fp32-argued
# tolerances do not hold): the GPU is hidden from this process and its subprocesses. LLMRL_TEST_GPU=1
# leaves it visible and runs the tests marked `gpu` (skipped otherwise); benchmarks/gpu_check.py is the GPU run.
if os.environ.get("LLMRL_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and LLMRL_TEST_GPU=1 (skipped otherwise)")
    config.addinivalue_line("markers", "slow: a long end-to-end run (over ~15 s on 2 cores): `make test-slow` runs these, "
                                       "`make test` the rest; CI runs both")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LLMRL_TEST_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="GPU test: set LLMRL_TEST_GPU=1 on a machine with a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # toy_task for in-process runs


@pytest.fixture(scope="session")
def embedded_path() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the llmrl cache."""
    from llmrl.models.loading import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


def save_tiny_llama(out, embedded_path: str, *, hidden: int, intermediate: int, heads: int, kv_heads: int,
                    positions: int) -> str:
    """Save a randomly initialised 2-layer Llama of these sizes, with the embedded model's tokenizer and
    chat template, to `out`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(embedded_path)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_path) -> str:
    """A randomly initialised 2-layer Llama (hidden 32) with the embedded model's tokenizer and chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), embedded_path, hidden=32, intermediate=64, heads=4,
                           kv_heads=2, positions=256)


def greedy_replies(engine, messages, max_new_tokens: int) -> list[str]:
    """An engine's greedy replies to chat prompts, made as eval makes them (one-turn episodes through
    rollout/episodes.py, the prompt cut to the engine's max_prompt_tokens)."""
    import dataclasses

    from llmrl.rollout.episodes import one_turn

    s = dataclasses.replace(engine.sampling, repetition_penalty=1.0, min_new_tokens=0, max_new_tokens=max_new_tokens)
    return one_turn(engine, engine.tokenizer, messages, group_size=1, seed=0, sampling=s, greedy=True).texts
