"""Fault injection: kills, signals, non-finite values, raising rewards, corrupt checkpoints, unwritable
and full disks, hostile data. After each, the run directory must resume to exactly the run that an
uninterrupted process produces."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import llmrl.training.loop as loop
from llmrl.algorithms.losses import LOSSES
from helpers import TESTS, assert_same_run, cli, lora_tensors, read_jsonl, run_cli, tiny_args, train_records
from llmrl.checkpoint import MANIFEST, _write_manifest, latest_checkpoint, load_checkpoint, verify_checkpoint
from llmrl.config import load_config, resolve
from llmrl.errors import ConfigError, DataError, RunStopped
from llmrl.tasks.math_hard import MathHardTask
from llmrl.training.run import build_policy

STEPS = 4


def args(model, out, steps=STEPS, **extra):
    return tiny_args(model, out, "grpo", steps=steps, **{"eval_interval": 0, **extra})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """An uninterrupted run of STEPS steps, checkpointed every step."""
    out = tmp_path_factory.mktemp("faults") / "reference"
    cli(*args(tiny_model_dir, out, save_interval=1, keep_checkpoints=0))
    return out


@pytest.mark.parametrize("fault, save_interval", [
    ("kill_in_rollout@3", 2),  # steps since the last checkpoint are lost and redone
    ("kill_in_save@2", 1),  # mid-save: the previous checkpoint stays usable
    ("kill_after_save@2", 1),
    ("kill_in_log@3", 1),  # a half-written metrics line
])
@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir, reference, fault, save_interval):
    out = tmp_path / "run"
    p = run_cli(*args(tiny_model_dir, out, save_interval=save_interval), fault=fault)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    cli("train", "--resume", str(out), "--trust_task_code")
    assert_same_run(reference, out, STEPS)
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path, tiny_model_dir, reference):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(TESTS / "faults.py"), "slow_rollout", *args(tiny_model_dir, out, save_interval=100)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(TESTS)})
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]  # saved, but stopped short: make and shells see it
    assert "resume with: llmrl train --resume" in err
    stopped_at = train_records(out)[-1]["step"]
    assert stopped_at < STEPS and (out / "checkpoints" / f"step_{stopped_at:06d}").is_dir()
    cli("train", "--resume", str(out), "--trust_task_code")
    assert_same_run(reference, out, STEPS)


@pytest.mark.slow
def test_second_signal_exits_at_once_and_leaves_a_resumable_run(tmp_path, tiny_model_dir, reference):
    out = tmp_path / "run"
    # slow_rollout: each step sleeps 1 s first, so the second signal lands inside the step
    proc = subprocess.Popen([sys.executable, str(TESTS / "faults.py"), "slow_rollout",
                             *args(tiny_model_dir, out, save_interval=1, steps=50)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(TESTS)})
    deadline = time.time() + 300
    while not (out / "checkpoints" / "latest").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    for line in proc.stderr:
        if "stopping after this step" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert latest_checkpoint(out) is not None
    cli("train", "--resume", str(out), "--steps", str(STEPS), "--trust_task_code")
    assert_same_run(reference, out, STEPS)


@pytest.mark.parametrize("fault, reason", [
    ("enospc_in_save@2", "No space left on device"),
    ("enospc_in_adapter@2", "No space left on device"),  # safetensors' SafetensorError, not an OSError
    ("eio_in_save@2", "Input/output error"),
    ("eio_in_latest@2", "Input/output error"),  # step 2 is complete, but `latest` still names step 1
])
@pytest.mark.slow
def test_a_failed_write_while_saving_keeps_the_previous_checkpoint(tmp_path, tiny_model_dir, reference, fault, reason):
    out = tmp_path / "run"
    p = run_cli(*args(tiny_model_dir, out, save_interval=1), fault=fault)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    previous = out / "checkpoints" / "step_000001"
    assert p.stderr.strip().splitlines()[-1] == (
        f"llmrl: stopped: could not write the checkpoint of step 2: {reason}; the previous checkpoint ({previous}) is "
        f"intact: fix the cause and run `llmrl train --resume {out} --trust_task_code`")  # toy_task is code
    assert latest_checkpoint(out) == previous and verify_checkpoint(previous) is None
    assert not list((out / "checkpoints").glob(".tmp-*"))
    cli("train", "--resume", str(out), "--trust_task_code")
    assert_same_run(reference, out, STEPS)


@pytest.mark.parametrize("fault, file, reason", [
    ("enospc_in_log@2", "metrics.jsonl", "No space left on device"),  # half of step 2's line is written
    ("eio_in_samples@2", "samples.jsonl", "Input/output error"),
])
@pytest.mark.slow
def test_a_failed_log_write_stops_at_the_last_checkpoint(tmp_path, tiny_model_dir, reference, fault, file, reason):
    """Step 2's records went with the disk, so step 2 is not saved: the resume redoes it and logs every step once."""
    out = tmp_path / "run"
    p = run_cli(*args(tiny_model_dir, out, save_interval=1), fault=fault)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    kept = out / "checkpoints" / "step_000001"
    assert p.stderr.strip().splitlines()[-1] == (
        f"llmrl: stopped: could not write {out / file}: {reason}; the previous checkpoint ({kept}) is intact: fix the "
        f"cause and run `llmrl train --resume {out} --trust_task_code`")
    assert latest_checkpoint(out) == kept and verify_checkpoint(kept) is None
    cli("train", "--resume", str(out), "--trust_task_code")
    assert_same_run(reference, out, STEPS)


@pytest.mark.slow
def test_a_failed_report_write_saves_the_step_and_stops(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = run_cli(*args(tiny_model_dir, out, steps=2, save_interval=100, eval_interval=1, eval_n=2), fault="eio_in_report@2")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    saved = out / "checkpoints" / "step_000001"  # the report after eval 0 was written, the one after step 1 not
    assert p.stderr.strip().splitlines()[-1] == (f"llmrl: stopped: could not write {out / 'report.html'}: Input/output "
                                                 f"error; checkpoint {saved} (step 1); resume with: llmrl train --resume {out} --trust_task_code")
    assert verify_checkpoint(saved) is None
    cli("train", "--resume", str(out), "--trust_task_code")
    assert [r["step"] for r in train_records(out)] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference, damage):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for step in (3, 4):
        shutil.rmtree(out / "checkpoints" / f"step_{step:06d}")
    (out / "checkpoints" / "latest").write_text("step_000002")
    target = out / "checkpoints" / "step_000002" / ("adapter_model.safetensors" if damage != "truncate" else "optimizer.pt")
    data = target.read_bytes()
    if damage == "flip":
        target.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        target.unlink()
    assert verify_checkpoint(target.parent) is not None
    p = cli("train", "--resume", str(out), "--trust_task_code")
    assert "step_000002 is incomplete or corrupt" in p.stderr
    assert_same_run(reference, out, STEPS)


def test_pickled_code_in_a_checkpoint_is_refused(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / "step_000001", ckpt)

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    (ckpt / "optimizer.pt").write_bytes(pickle.dumps(Evil()))
    (ckpt / MANIFEST).unlink()
    _write_manifest(ckpt)  # even a checkpoint that verifies is never unpickled as code
    cfg = load_config(reference / "config.yaml")
    model, _, _ = build_policy(cfg, resolve(cfg))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ConfigError, match="optimizer.pt"):
        load_checkpoint(ckpt, model, opt, torch.Generator())


def test_keep_newest_checkpoints(reference, tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cli(*args(tiny_model_dir, out, save_interval=1, keep_checkpoints=2))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000003", "step_000004"]


def test_resume_with_an_incompatible_config_names_the_fields(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    p = run_cli("train", "--resume", str(out), "--lora_r", "8", "--lr", "0.5", "--trust_task_code")
    assert p.returncode == 2
    assert "config differs from step_000004: lr (0.01 → 0.5), lora_r (4 → 8)" in p.stderr


def test_unwritable_output_dir_is_one_clear_line(tmp_path, tiny_model_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run_cli(*args(tiny_model_dir, blocker / "run"))
    assert p.returncode == 2 and "is not writable" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_existing_run_is_not_overwritten_silently(reference, tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    p = run_cli(*args(tiny_model_dir, out))
    assert p.returncode == 2 and "already holds a run" in p.stderr
    assert (out / "checkpoints" / "step_000004").is_dir()


def in_process(tiny_model_dir, out, **overrides):
    argv = args(tiny_model_dir, out, **overrides)[1:]
    return load_config(None, {argv[i].lstrip("-"): argv[i + 1] for i in range(0, len(argv), 2)})


def test_injected_nan_skips_updates_and_keeps_parameters_finite(tmp_path, tiny_model_dir, monkeypatch):
    real = LOSSES["grpo"]
    calls = {"n": 0}

    def sometimes_nan(*a, **k):
        calls["n"] += 1
        pg, stats = real(*a, **k)
        return (pg * float("nan") if calls["n"] in (1, 2, 5) else pg), stats

    monkeypatch.setitem(LOSSES, "grpo", sometimes_nan)
    result = loop.train(in_process(tiny_model_dir, tmp_path / "run", eval_n=0))
    records = train_records(tmp_path / "run")
    assert records[-1]["train/skipped_updates"] == 3  # minibatches 1, 2 and 5 each spoiled one optimizer step
    assert records[-1]["train/optimizer_steps"] == STEPS * 4 - 3
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_repeated_nan_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(LOSSES, "grpo", lambda *a, **k: (torch.tensor(float("nan")), {"clip_frac": 0.0}))
    out = tmp_path / "run"
    with pytest.raises(RunStopped, match="non-finite updates in a row"):
        loop.train(in_process(tiny_model_dir, out, eval_n=0, max_bad_steps=3, save_interval=100))
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "step_000001"  # step 1 makes 4 updates, all skipped: 4 in a row >= 3
    weights = lora_tensors(ckpt)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert all(weights[k].abs().sum() == 0 for k in weights if "lora_B" in k)  # never updated


def test_raising_reward_scores_zero_and_is_counted(tmp_path, tiny_model_dir):
    loop.train(in_process(tiny_model_dir, tmp_path / "run", task="toy_task:RaisingTask", eval_n=0))
    records = train_records(tmp_path / "run")
    assert records[-1]["reward/errors"] == STEPS * 6 // 3  # every third of 6 completions per step
    with pytest.raises(RunStopped, match="reward function raised RuntimeError: grader crashed"):
        loop.train(in_process(tiny_model_dir, tmp_path / "strict", task="toy_task:RaisingTask", strict_rewards="true"))


def test_long_prompts_are_truncated_and_counted_or_skipped(tmp_path, tiny_model_dir):
    loop.train(in_process(tiny_model_dir, tmp_path / "t", max_prompt_tokens=8, eval_n=0, steps=1))
    assert train_records(tmp_path / "t")[0]["rollout/prompts_truncated"] == 2
    # dynamic sampling picks rows group by group: each prompt is still counted once per round it was drawn in
    loop.train(in_process(tiny_model_dir, tmp_path / "d", max_prompt_tokens=8, eval_n=0, steps=1, batch_size=3,
                          dynamic_sampling="true", dynamic_sampling_rounds=2))
    [record] = train_records(tmp_path / "d")
    assert record["rollout/prompts_truncated"] == 3 * record["rollout/sampling_rounds"]
    with pytest.raises(RunStopped, match="exceed max_prompt_tokens=8"):
        loop.train(in_process(tiny_model_dir, tmp_path / "s", max_prompt_tokens=8, long_prompts="skip", eval_n=0))


def test_hostile_math_rows_are_skipped_and_counted(tmp_path):
    good = {"problem": "What is 2+3?", "solution": "$\\boxed{5}$", "level": "Level 5", "type": "Algebra"}
    lines = [
        json.dumps(good),
        '{"problem": "unterminated',
        json.dumps({**good, "problem": None}),
        json.dumps({**good, "problem": 42}),
        json.dumps({**good, "problem": "   "}),
        json.dumps({**good, "problem": "bad \u0000 byte"}),
        json.dumps({k: v for k, v in good.items() if k != "solution"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({**good, "solution": "no box"}),
    ]
    f = tmp_path / "math.jsonl"
    f.write_bytes(("\n".join(lines) + "\n").encode() + b'{"problem": "\xff\xfe", "solution": "$\\\\boxed{1}$", "level": "Level 5"}\n')
    task = MathHardTask(data=str(f))
    assert task.data_report["train"]["kept"] == 1
    assert task.data_report["train"]["dropped"] == {
        "not a JSON object": 2, "missing problem": 1, "problem is not text": 1, "empty problem": 1,
        "invalid characters in problem": 2, "missing solution": 1, "no numeric answer": 1,
    }
    f.write_text(lines[1] + "\n" + lines[3] + "\n")
    with pytest.raises(DataError, match="no level-5 problems with numeric answers"):
        MathHardTask(data=str(f))


@pytest.mark.slow
def test_a_reward_function_that_mostly_raises_is_counted_in_training_and_eval(tmp_path, tiny_model_dir):
    """Exit 0, no traceback; the raises score 0 and are counted in reward/errors and eval/reward_errors."""
    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=f"{TESTS / 'raising_reward.py'}:reward",
                           prompts=str(TESTS.parent / "examples" / "brevity_prompts.jsonl"), eval_n=8))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all("eval/scored" in r for r in evals)
    assert train[-1]["reward/errors"] > 2 * 6 / 2  # most of the 12 completions raised
    assert sum(r["eval/reward_errors"] for r in evals) > 3 * 8 / 2
    assert all(0 <= r["eval/reward_errors"] <= 8 for r in evals)
