"""Data parallelism with torchrun on CPU (gloo): 2 processes equal 1 process, resume across world
sizes, rank-0-only files, and a killed rank ends the run."""

import time
from types import SimpleNamespace

import pytest
import torch

from helpers import cli, lora_tensors, read_jsonl, run_cli, tiny_args


def args(model, out, steps=3, **extra):
    # global batch 2 prompts × 3 = 6 completions, global minibatch 3 (per rank: 1 prompt, ~1.5 rows);
    # lr 1e-3: Adam turns rounding differences in near-zero gradients into steps of up to lr, so the
    # 1e-5 tolerance stays well under one step (~1e-3) that a missing or doubled gradient would show
    return tiny_args(model, out, "grpo", steps=steps, lora_dropout=0, eval_n=3, lr="1e-3", **extra)


def max_diff(a, b):
    ta, tb = lora_tensors(a), lora_tensors(b)
    assert ta.keys() == tb.keys()
    return max((ta[k] - tb[k]).abs().max().item() for k in ta)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("dist") / "one"
    cli(*args(tiny_model_dir, out))
    return out


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, tiny_model_dir, one_process):
    two = tmp_path / "two"
    p = cli(*args(tiny_model_dir, two), "--nproc", "2")
    assert "launching 2 processes" in p.stderr
    assert max_diff(one_process / "checkpoints/step_000003", two / "checkpoints/step_000003") <= 1e-5
    m1, m2 = read_jsonl(one_process / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [0, 1, 1, 2, 2, 3, 3]  # each record once
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "adv/std", "train/optimizer_steps", "rollout/completions", "eval/distinct"):
            if k in a:
                assert b[k] == pytest.approx(a[k], abs=1e-5), k
    samples = read_jsonl(two / "samples.jsonl")
    assert len(samples) == 3 * 6  # every completion of every step, once
    assert sorted(p.name for p in (two / "checkpoints").glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one(tmp_path, tiny_model_dir, one_process):
    out = tmp_path / "run"
    cli(*args(tiny_model_dir, out, steps=2), "--nproc", "2")
    p = cli("train", "--resume", str(out), "--steps", "3", "--trust_task_code")
    assert "resuming a 2-process checkpoint on 1 processes" not in p.stderr  # 1 process needs no per-rank streams
    assert max_diff(one_process / "checkpoints/step_000003", out / "checkpoints/step_000003") <= 1e-5
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 1, 2, 2, 3, 3]


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two(tmp_path, tiny_model_dir, one_process):
    out = tmp_path / "run"
    cli(*args(tiny_model_dir, out, steps=1))
    p = cli("train", "--resume", str(out), "--steps", "3", "--nproc", "2", "--trust_task_code")
    assert "resuming a 1-process checkpoint on 2 processes" in p.stderr
    assert max_diff(one_process / "checkpoints/step_000003", out / "checkpoints/step_000003") <= 1e-5


@pytest.mark.slow
def test_a_killed_rank_ends_the_run(tmp_path, tiny_model_dir):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(tests) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tests / "faults.py"), "kill_in_rollout@2%1", *args(tiny_model_dir, tmp_path / "run", steps=4)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0 and time.monotonic() - t0 < 240
    assert "ChildFailedError" in p.stderr or "failed" in p.stderr.lower()
    assert (tmp_path / "run/checkpoints/step_000001").exists()  # the last good checkpoint is kept


def test_bad_world_settings_are_one_line_errors(tmp_path, tiny_model_dir):
    p = run_cli(*args(tiny_model_dir, tmp_path / "r", batch_size=3), "--nproc", "2")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "divisible" in p.stderr
    p = run_cli(*args(tiny_model_dir, tmp_path / "r2", device="cuda"), "--nproc", "2") if not torch.cuda.is_available() else None
    if p is not None:
        assert p.returncode != 0 and "CUDA" in p.stderr


def test_each_rank_saves_and_restores_its_own_cuda_rng_stream(monkeypatch):
    """On CUDA every rank's LoRA dropout draws from its own GPU's generator: a checkpoint keeps rank r's
    as cuda_rank<r> and a resume puts it back on rank r's device (rank 0's states used to be restored
    into every rank). CUDA is stood in for by a fake generator per device (no GPU here)."""
    from llmrl.training import run as run_mod
    from llmrl.training.distributed import Dist

    gpus = {0: torch.tensor([1, 2], dtype=torch.uint8), 1: torch.tensor([7, 9], dtype=torch.uint8)}
    current = {"device": 1}
    fake = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                           current_device=lambda: current["device"],
                           get_rng_state=lambda d: gpus[d].clone(),
                           set_rng_state=lambda t, d: gpus.__setitem__(d, t.clone()))
    monkeypatch.setattr(run_mod.torch, "cuda", fake)
    saved = {}
    for rank in (0, 1):  # what save() gathers: each process reads its own device
        current["device"] = rank
        saved |= {f"{k}_rank{rank}": t for k, t in run_mod.rank_rng_state().items()}
    assert torch.equal(saved["cuda_rank1"], torch.tensor([7, 9], dtype=torch.uint8))
    gpus[1] = torch.tensor([0, 0], dtype=torch.uint8)  # rank 1's stream moved on, then the run was killed
    current["device"] = 1
    state = {"rank_rng": saved, "world_size": 2, "step": 3}
    run_mod.restore_rank_rng(state, SimpleNamespace(seed=0), Dist(1, 2, 1))
    assert torch.equal(gpus[1], torch.tensor([7, 9], dtype=torch.uint8)) and torch.equal(gpus[0], torch.tensor([1, 2], dtype=torch.uint8))


@pytest.mark.slow
def test_two_nodes_by_c10d_rendezvous_equal_one_process(tmp_path, tiny_model_dir, one_process):
    """Two launches of `llmrl train --nnodes 2` (one process each, as on two machines) meet through torchrun's c10d
    rendezvous on 127.0.0.1 and train as one 2-rank run: the same weights as one process, within the 2-rank tolerance."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(tests) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "nodes"
    command = [sys.executable, "-m", "llmrl", *args(tiny_model_dir, out), "--nnodes", "2", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    nodes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    assert all("on each of 2 nodes" in err for _, err in results)
    assert max_diff(one_process / "checkpoints/step_000003", out / "checkpoints/step_000003") <= 1e-5
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 1, 2, 2, 3, 3]  # each record once
