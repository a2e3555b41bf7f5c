"""One precision rule for the same weights in every command (config.precision_rule): `llmrl eval --run` of a run
and `llmrl eval --base --model` of its merged export compute the same products (trained weights in fp32, a LoRA
adapter merged as export merges it), so they give the same greedy completions and print the same precision line,
also where `dtype: auto` would pick bf16 products for an unrecorded model."""

import os

import pytest

from helpers import cli, read_jsonl
from llmrl.config import (PRECISION_FILE, TRAINED_DTYPE, evaluation, exported_dtype, load_config, precision_rule,
                          recorded_dtype)
from llmrl.errors import ConfigError
from llmrl.export import chat
from llmrl.model_card import model_card


def test_a_named_dtype_wins_then_the_weights_record_then_the_config():
    recorded = precision_rule(None, "float32", "auto")
    assert recorded[0] == "float32" and recorded[1].startswith("precision: float32 (recorded with the trained weights")
    assert precision_rule(None, "float32", "bfloat16") == recorded  # the record, not the run's training dtype
    assert precision_rule("bfloat16", "float32", "auto") == ("bfloat16", None)  # named: the plan's own line
    assert precision_rule(None, None, "auto") == ("auto", None)  # nothing recorded: measured as configured
    assert TRAINED_DTYPE == "float32"
    assert [exported_dtype(d) for d in ("float32", "bfloat16", "float16")] == ["float32", "bfloat16", "float32"]


def test_trained_weights_evaluate_in_fp32_merged_where_auto_would_pick_bf16_products(monkeypatch):
    monkeypatch.setenv("LLMRL_CPU_DTYPE", "bfloat16")  # as auto decides on a CPU where bf16 products pay
    cfg = load_config(None, {"device": "cpu", "merge_lora_sampling": "false"})
    _, plan, line = evaluation(cfg, None, TRAINED_DTYPE)
    assert not plan.bf16_matmul and str(plan.dtype) == "torch.float32" and plan.merge_lora and not plan.with_ref
    assert line == precision_rule(None, TRAINED_DTYPE, "auto")[1]
    _, plan, line = evaluation(cfg, None, None)  # a model nobody recorded: auto
    assert plan.bf16_matmul and line == plan.precision and "LLMRL_CPU_DTYPE=bfloat16" in line
    _, plan, _ = evaluation(load_config(None, {"device": "cpu", "finetune": "full"}), None, TRAINED_DTYPE)
    assert plan.full and plan.autocast is None and not plan.merge_lora  # full weights: fp32 products, nothing to merge


def test_a_model_directory_records_its_precision_in_llmrl_json(tmp_path):
    assert recorded_dtype(str(tmp_path)) is None and recorded_dtype("smollm2-135m-instruct") is None
    record = tmp_path / PRECISION_FILE
    record.write_text('{"dtype": "bfloat16"}')
    assert recorded_dtype(str(tmp_path)) == "bfloat16"
    record.write_text('{"dtype": "float16"}')
    with pytest.raises(ConfigError, match="must be float32 or bfloat16"):
        recorded_dtype(str(tmp_path))
    record.write_text("float32")
    with pytest.raises(ConfigError, match="not a readable llmrl precision record"):
        recorded_dtype(str(tmp_path))


def test_the_model_card_names_the_config_file_not_this_machines_path(tmp_path):
    card = model_card(load_config(None, {}), 3, tmp_path / "run")
    assert "`llmrl train --config config.yaml`" in card and str(tmp_path) not in card


EMBEDDED = ["--model", "smollm2-135m-instruct", "--task", "toy_task:CharTask", "--max_new_tokens", "16",
            "--max_prompt_tokens", "64"]  # CharTask: rewards that vary, so the weights move


def precision_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("llmrl: precision:")]


@pytest.mark.slow
@pytest.mark.parametrize("finetune, lr", [("lora", "1e-2"), ("full", "1e-4")])
def test_eval_of_a_run_and_of_its_merged_export_give_the_same_completions(tmp_path, monkeypatch, capsys, finetune, lr):
    """On the embedded model, with bf16 products forced for unrecorded weights (what auto picks on a CPU with a
    bf16 unit): the export records float32, so its eval is the run's, completion for completion (before the rule:
    7 and 5 of 8 equal); the exported files are 0666 less the umask (safetensors writes 0600), the card names no
    path of this machine."""
    monkeypatch.setenv("LLMRL_CPU_DTYPE", "bfloat16")
    run, out = tmp_path / "run", tmp_path / "export"
    trained = cli("train", *EMBEDDED, "--finetune", finetune, "--steps", "1", "--batch_size", "2", "--group_size", "2",
        "--minibatch_size", "4", "--grad_accum_steps", "1", "--lr", lr, "--warmup_steps", "0", "--lora_dropout", "0",
        "--eval_n", "0", "--save_interval", "1", "--output_dir", str(run))
    exported = cli("export", str(run), "--out", str(out), "--merge", "--trust_task_code")
    of_run = cli("eval", "--run", str(run), "--eval_n", "16", "--output", str(tmp_path / "run.jsonl"),
                 "--trust_task_code")
    of_export = cli("eval", "--base", *EMBEDDED, "--model", str(out), "--eval_n", "16",
                    "--output", str(tmp_path / "export.jsonl"))
    expected = [r["completion"] for r in read_jsonl(tmp_path / "run.jsonl")]
    assert [r["completion"] for r in read_jsonl(tmp_path / "export.jsonl")] == expected and len(expected) == 16
    assert any(expected)
    line = precision_rule(None, TRAINED_DTYPE, "auto")[1]
    assert precision_lines(of_run.stderr) == precision_lines(of_export.stderr) == [f"llmrl: {line}"]
    assert f"llmrl: checkpoints (eval --run, chat, export): {line}" in trained.stderr
    assert precision_lines(exported.stderr) == [f"llmrl: {line}"] and "greedy check: 4/4" in exported.stderr
    capsys.readouterr()
    assert chat(run, lines=["Say something about 3."], max_new_tokens=4, write=print, trust_task_code=True) == 0
    assert precision_lines(capsys.readouterr().err) == [f"llmrl: {line}"]

    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {
        f.name: oct(0o666 & ~umask) for f in out.iterdir()}
    assert "model.safetensors" in {f.name for f in out.iterdir()}
    card = (out / "README.md").read_text()
    assert "`llmrl train --config config.yaml`" in card and str(tmp_path) not in card
