"""What a first-time user meets: one-line errors that leave nothing behind, help and version, resume
messages, the Python API example, and the exported model outside llmrl."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import TESTS, cli, lora_tensors, read_jsonl, run_cli, tiny_args

REPO = TESTS.parent


def test_cuda_on_a_cpu_torch_and_math_hard_offline_are_one_line_and_leave_no_directory(tmp_path, tiny_model_dir):
    if torch.cuda.is_available():
        return  # the point is a machine without CUDA
    out = tmp_path / "cuda"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", device="cuda"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "device=cuda" in p.stderr, p.stderr[-1000:]
    assert not out.exists()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "math"
    p = subprocess.run([sys.executable, "-m", "llmrl", *tiny_args(tiny_model_dir, out, "grpo", task="math_hard")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr[-1000:]
    assert "--math_data" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()
    p = run_cli("eval", "--base", "--model", tiny_model_dir, "--task", "toy_task:CharTask", "--device", "cuda")
    assert p.returncode == 2 and "device=cuda" in p.stderr and "Traceback" not in p.stderr


def test_version_and_did_you_mean():
    from llmrl import __version__

    p = run_cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"llmrl {__version__}"
    p = run_cli("train", "--gruop_size", "4")
    assert p.returncode == 2 and "did you mean --group_size?" in p.stderr and "llmrl train --help" in p.stderr


def test_resume_says_where_it_starts_and_a_finished_run_does_nothing(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = cli(*tiny_args(tiny_model_dir, out, "grpo", steps=1, eval_n=0))
    assert f"llmrl: adapter: {out / 'checkpoints' / 'step_000001'}" in p.stderr
    p = cli("train", "--resume", str(out), "--steps", "2")
    assert f"resuming {out} from step_000001 (step 1 of 2)" in p.stderr
    p = cli("train", "--resume", str(out), "--steps", "2")
    assert "already ran its 2 steps; nothing to do" in p.stderr and p.stdout.strip() == ""
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == 2


def test_api_example_runs(tmp_path, tiny_model_dir):
    p = subprocess.run([sys.executable, str(REPO / "examples" / "api_example.py"), tiny_model_dir], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600,
                       env=os.environ)
    assert p.returncode == 0, p.stderr[-2000:]
    adapter, reward = p.stdout.split()[-2:]
    assert adapter.endswith("step_000002") and 0.0 <= float(reward) <= 1.0
    records = read_jsonl(tmp_path / "runs" / "api-example" / "metrics.jsonl")
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]


def test_export_merge_loads_with_plain_transformers_and_gives_llmrl_eval_completions(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, run, "grpo", steps=2, eval_n=4, lr=0.05, lora_dropout=0))
    cli("eval", "--run", str(run), "--output", str(tmp_path / "eval.jsonl"))
    expected = [r["completion"] for r in read_jsonl(tmp_path / "eval.jsonl")]
    cli("export", str(run), "--out", str(tmp_path / "merged"), "--merge")
    cli("export", str(run), "--out", str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model_dir
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "grpo on toy_task:CharTask" in card and "steps | 2 of 2" in card and "eval/distinct" in card
    checkpoint = run / "checkpoints" / "step_000002"
    assert "steps | 2 of 2" in (checkpoint / "README.md").read_text()  # not PEFT's empty template
    assert json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    from toy_task import CharTask

    got = []
    for ex in CharTask().eval_examples(4):
        text = tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        got.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    assert got == expected
    assert any(expected)  # something was generated
    p = run_cli("export", str(run), "--out", str(tmp_path / "merged"))
    assert p.returncode == 2 and "not empty" in p.stderr


def test_export_merges_in_fp32_when_the_run_trained_in_bf16(tmp_path, tiny_model_dir):
    """A run with bf16 weights: the merged export is W + s·B·A computed in fp32 from the fp32 base (a merge
    into bf16 weights rounds each element to 8 bits of mantissa and loses deltas below that), saved in the
    requested dtype, and the export prints its greedy check."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, run, "grpo", steps=1, eval_n=2, lr=3e-3, lora_dropout=0, dtype="bfloat16"))
    p = cli("export", str(run), "--out", str(tmp_path / "merged"), "--merge")
    assert "greedy check: 4/4 eval prompts" in p.stderr  # check=4 prompts by default
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    adapter = lora_tensors(run / "checkpoints" / "step_000001")
    key = next(k for k in merged if k.endswith("layers.0.self_attn.q_proj.weight"))
    a = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    b = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    delta = (8 / 4) * b.float() @ a.float()  # lora_alpha / r
    assert merged[key].dtype == torch.float32 and delta.abs().max() > 0
    # fp32: W + ΔW rounded once (|error| ≤ u·|W + ΔW|, u = 2^-24); a bf16 merge errs by up to 2^-9·|W|
    expected = base[key].float() + delta
    assert (merged[key] - expected).abs().max() <= 2.0**-23 * expected.abs().max()
    p = cli("export", str(run), "--out", str(tmp_path / "bf16"), "--merge", "--dtype", "bfloat16")
    assert load_file(tmp_path / "bf16" / "model.safetensors")[key].dtype == torch.bfloat16


def test_chat_replies_with_the_policy(tmp_path, tiny_model_dir):
    from llmrl.export import chat

    run = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, run, "grpo", steps=1, eval_n=0))
    lines: list[str] = []
    assert chat(run, lines=["Say something about 3.", "", "Again."], max_new_tokens=5, write=lines.append) == 0
    assert lines[0].startswith("llmrl chat:") and len(lines) == 3


def test_readme_shows_the_tested_api_example_and_the_brevity_command():
    readme = (REPO / "README.md").read_text()
    code = (REPO / "examples" / "api_example.py").read_text().split('"""', 2)[2].strip()
    assert code in readme  # the README's example is the file the test above runs
    doc = (REPO / "examples" / "brevity_reward.py").read_text()
    assert "llmrl train --config configs/brevity.yaml" in doc and "llmrl train --config configs/brevity.yaml" in readme


def test_a_run_raises_no_future_warning_from_transformers_or_peft(tmp_path, tiny_model_dir):
    """Both checkpointing settings, with every FutureWarning turned into an error."""
    for checkpointing in ("true", "false"):
        out = tmp_path / checkpointing
        args = tiny_args(tiny_model_dir, out, "grpo", steps=1, eval_n=2, gradient_checkpointing=checkpointing)
        p = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-m", "llmrl", *args], capture_output=True,
                           text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(TESTS)})
        assert p.returncode == 0 and "FutureWarning" not in p.stderr, p.stderr[-2000:]
    from llmrl.models.loading import add_lora

    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, 0.0, ["q_proj"], True)
    base = model.get_base_model()  # still on, under the new name where transformers has it (5.2x), else the old
    assert base.is_activation_checkpointing if hasattr(type(base), "is_activation_checkpointing") else base.is_gradient_checkpointing
