"""Config loading and the one-line errors of invalid values."""

import subprocess
import sys

import pytest

from llmrl.config import TrainConfig, load_config
from llmrl.errors import ConfigError


def test_defaults_match_the_spec():
    c = TrainConfig()
    assert (c.model, c.steps, c.batch_size, c.group_size, c.max_new_tokens, c.lr) == (
        "Qwen/Qwen2.5-Math-1.5B-Instruct", 1200, 8, 6, 512, 3e-5)
    assert (c.adam_beta1, c.adam_beta2, c.warmup_steps, c.clip_eps, c.kl_coef, c.max_grad_norm, c.adv_clip) == (
        0.9, 0.95, 100, 0.1, 0.05, 0.5, 5.0)
    assert (c.lora_r, c.lora_alpha, c.lora_dropout, len(c.lora_target_modules)) == (16, 32, 0.05, 7)
    assert c.rollout_size == 48


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("steps: 7\nbatch_size: 2\ngroup_size: 4\nminibatch_size: 4\nlora_target_modules: [q_proj, v_proj]\n")
    c = load_config(f, {"steps": "9", "normalize_advantages": "true", "eval_n": "none"})
    assert (c.steps, c.batch_size, c.normalize_advantages, c.eval_n) == (9, 2, True, None)
    assert c.lora_target_modules == ["q_proj", "v_proj"]
    assert load_config(None, {"lora_target_modules": "q_proj,k_proj"}).lora_target_modules == ["q_proj", "k_proj"]


@pytest.mark.parametrize("overrides, needle", [
    ({"batch_size": "-1"}, "batch_size=-1: must be at least 1"),
    ({"min_new_tokens": "10", "max_new_tokens": "5"}, "min_new_tokens=10: must not exceed max_new_tokens=5"),
    ({"task": "chess"}, "task='chess': unknown task"),
    ({"algo": "ppo2"}, "algo='ppo2': unknown algorithm"),
    ({"model": "not-an-alias"}, "model='not-an-alias'"),
    ({"algo": "reinforce", "ppo_epochs": "2"}, "ppo_epochs=2: must be 1 with algo=reinforce"),
    ({"batch_size": "3", "group_size": "3", "minibatch_size": "4"}, "minibatch_size=4: must divide batch_size*group_size=9"),
    ({"unknown_key": "1"}, "unknown config key 'unknown_key'"),
    ({"steps": "1.5"}, "steps: expected int"),
    ({"top_p": "0"}, "top_p=0.0: must be in (0, 1]"),
    ({"temperature": "0"}, "temperature=0.0: must be positive"),
    ({"clip_eps": "1.5"}, "clip_eps=1.5"),
    ({"normalize_advantages": "maybe"}, "normalize_advantages: expected bool"),
    ({"math_data": "/no/such/file.jsonl"}, "math_data='/no/such/file.jsonl': no such file"),
])
def test_invalid_values_name_field_and_rule(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_yaml_unknown_key_and_bad_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):
        load_config(f)
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(f)


@pytest.mark.parametrize("args, needle", [
    (["--algo", "reinforce", "--ppo_epochs", "2"], "ppo_epochs=2: must be 1 with algo=reinforce"),
    (["--nonsense", "3"], "unknown option --nonsense"),
    (["--group_size", "0"], "group_size=0: must be at least 1"),
    (["--dtype", "float16"], "dtype='float16': float16 is not supported (no loss scaling"),
    (["--model", "nosuchmodel"], "model='nosuchmodel'"),
    (["--config", "/no/such.yaml"], "config file '/no/such.yaml'"),
])
def test_cli_errors_are_one_line_with_exit_code_2(args, needle):
    p = subprocess.run([sys.executable, "-m", "llmrl", "train", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_help_lists_documented_fields():
    p = subprocess.run([sys.executable, "-m", "llmrl", "train", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0
    assert "--kl_coef" in p.stdout and "weight of the KL penalty" in p.stdout
    for title in ("task and data", "sampling", "algorithm", "optimisation", "LoRA", "evaluation and logging",
                  "checkpoints and health", "advanced speed switches"):
        assert f"\n{title} (config fields" in p.stdout, title
    assert p.stdout.index("--lr ") < p.stdout.index("advanced speed switches") < p.stdout.index("--onednn_linear")
    assert not any(block.count("(default") > 1 for block in p.stdout.split("  --")), "one default note per option"
    p = subprocess.run([sys.executable, "-m", "llmrl", "eval", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--adapter" in p.stdout and "--eval_n" in p.stdout and "--lr " not in p.stdout
    p = subprocess.run([sys.executable, "-m", "llmrl", "eval", "--base", "--lr", "5"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "training options, which eval does not use" in p.stderr


def test_every_field_has_one_help_section():
    from llmrl.config import FIELDS, SECTIONS

    listed = [name for names in SECTIONS.values() for name in names]
    assert sorted(listed) == sorted(FIELDS)


@pytest.mark.parametrize("native_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_precision_on_cuda_follows_native_bf16(monkeypatch, native_bf16, expected):
    """dtype=auto on a GPU: bf16 only where the GPU has it natively (Ampere+); a T4 or V100 gets fp32 (its
    emulated bf16 is slow, and fp16 would need loss scaling)."""
    import torch

    from llmrl.models.loading import pick_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16 or including_emulation)
    dtype, bf16_products, line = pick_dtype("auto", torch.device("cuda"))
    assert dtype == getattr(torch, expected) and not bf16_products and expected in line


def test_cuda_device_rules(monkeypatch):
    """--device cuda:N with several processes would put every rank on GPU N; the in-process vLLM engine
    always takes the first visible GPU: both are refused with one line saying what to do instead."""
    from llmrl.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="device='cuda:1': with 2 processes each rank takes the GPU of its LOCAL_RANK"):
        load_config(None, {"device": "cuda:1", "batch_size": 2, "minibatch_size": 6})
    load_config(None, {"device": "cuda", "batch_size": 2, "minibatch_size": 6})
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="vLLM engine always runs on the first visible GPU"):
        load_config(None, {"device": "cuda:1", "rollout_engine": "vllm"})


def test_gpu_plan(monkeypatch):
    """A GPU plan (CUDA faked: no GPU here): forwards capped at CUDA_TOKEN_BUDGET padded tokens (the fp32
    logits of a whole math_hard rollout are ~20 GB); with gradient checkpointing (the update's full-sequence
    layout) the bf16 old/ref scoring uses the same layout, not the shared prefix, as the two round differently."""
    import torch

    from llmrl.config import CUDA_TOKEN_BUDGET, resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    plan = resolve(load_config(None, {"device": "cuda", "gradient_checkpointing": True}))
    assert plan.dtype == torch.bfloat16 and plan.token_budget == CUDA_TOKEN_BUDGET < 64 * 1024
    assert not plan.shared_prefix_update and not plan.shared_prefix_scoring
    plan = resolve(load_config(None, {"device": "cuda", "gradient_checkpointing": False}))
    assert plan.shared_prefix_update and plan.shared_prefix_scoring
    # fp32 products: both layouts agree to ~1e-6, the shared prefix stays on for scoring
    plan = resolve(load_config(None, {"device": "cuda", "dtype": "float32", "gradient_checkpointing": True}))
    assert plan.shared_prefix_scoring and not plan.shared_prefix_update


def test_async_and_server_rules(monkeypatch):
    """max_staleness needs the server engine (the in-process engines sample the weights the update changes)
    and no dynamic sampling, and makes the old log-probs the engine's (the behaviour policy) without being
    told; vllm-server is single-process, vllm runs an engine per rank."""
    from llmrl.config import resolve
    from llmrl.errors import ConfigError

    for bad, message in [({"max_staleness": 1}, "needs rollout_engine=vllm-server"),
                         ({"rollout_engine": "vllm", "max_staleness": 2}, "needs rollout_engine=vllm-server"),
                         ({"rollout_engine": "vllm-server", "max_staleness": -1}, "must be 0"),
                         ({"rollout_engine": "vllm-server", "max_staleness": 1, "dynamic_sampling": True},
                          "does not combine with dynamic_sampling"),
                         ({"server_url": "http://127.0.0.1:8000"}, "needs rollout_engine=vllm-server")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad)
    cfg = load_config(None, {"rollout_engine": "vllm-server", "max_staleness": 1, "device": "cpu"})
    assert cfg.old_logprobs == "trainer" and resolve(cfg).engine_old
    assert not resolve(load_config(None, {"rollout_engine": "vllm-server", "device": "cpu"})).engine_old
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="vllm-server is single-process"):
        load_config(None, {"rollout_engine": "vllm-server", "batch_size": 2, "minibatch_size": 6})
    load_config(None, {"rollout_engine": "vllm", "batch_size": 2, "minibatch_size": 6})


@pytest.mark.parametrize("key, value", [("env_timeout", "inf"), ("lr", "nan"), ("kl_coef", "-inf"), ("env_timeout", "1e6")])
def test_numbers_must_be_finite_and_env_timeout_bounded(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        load_config(None, {key: value})
