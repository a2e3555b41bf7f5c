"""FSDP2 (`--shard fsdp`, gloo on CPU): sharded full weights and sharded LoRA bases train as one process does,
each rank holds about half the trained state and writes its own checkpoint shards (DCP), a SIGKILLed sharded run
resumes exactly, and its checkpoint resumes on one process and exports as a plain model.

Tolerance: the ranks' gradients are reduce-scattered as fp32 sums, so 2 ranks differ from 1 only in the order of
those sums (a few ulps of each gradient, ~1e-7 relative). Adam's step is ~lr = 1e-3 per weight and per step, so
after 3 steps the weights agree to well under 1e-5 unless a gradient is lost, doubled or averaged (a factor of 2 in
each gradient changes Adam's steps where eps matters and every loss-scaled quantity after clipping)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import cli, read_jsonl, run_cli, tiny_args

pytestmark = pytest.mark.slow


def args(model, out, steps=3, **extra):
    return tiny_args(model, out, "grpo", steps=steps, **{"lora_dropout": 0, "eval_n": 3, "lr": "1e-3", **extra})


def tensors(ckpt: Path, name: str) -> dict:
    """A checkpoint's trained weights: its safetensors file, or its DCP shards consolidated (sharded full weights)."""
    if not (ckpt / ".metadata").is_file():
        return load_file(ckpt / name)
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, ckpt.parent / f"{ckpt.name}.pt")
    weights = torch.load(ckpt.parent / f"{ckpt.name}.pt", weights_only=True)["model"]
    (ckpt.parent / f"{ckpt.name}.pt").unlink()
    return weights


def max_diff(a: Path, b: Path, name: str) -> float:
    ta, tb = tensors(a, name), tensors(b, name)
    shared = ta.keys() & tb.keys()
    assert set(ta) - shared <= {"lm_head.weight"} and set(tb) - shared <= {"lm_head.weight"}  # tied: saved once or twice
    return max((ta[k] - tb[k]).abs().max().item() for k in shared)


@pytest.fixture(scope="module")
def full_one(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("fsdp") / "one"
    cli(*args(tiny_model_dir, out, finetune="full"))
    return out


def test_full_weights_on_two_sharded_ranks_equal_one_process(tmp_path, tiny_model_dir, full_one):
    two = tmp_path / "two"
    p = cli(*args(tiny_model_dir, two, finetune="full", shard="fsdp"), "--nproc", "2")
    assert "FSDP2: 2 blocks fully_shard'ed over 2 ranks" in p.stderr
    step3 = "checkpoints/step_000003"
    assert sorted(f.name for f in (two / step3).glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a shard each
    assert not (two / step3 / "optimizer.pt").exists()  # AdamW's state is in the shards too
    assert max_diff(full_one / step3, two / step3, "model.safetensors") <= 1e-5
    one_records, two_records = read_jsonl(full_one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in two_records] == [r["step"] for r in one_records] == [0, 1, 1, 2, 2, 3, 3]  # once each
    for a, b in zip(one_records, two_records):
        if "reward/mean" in a:
            assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-5)
            # parameters + gradients + AdamW state: each rank holds its half of every tensor
            assert b["train/state_mb"] <= 0.6 * a["train/state_mb"], (a["train/state_mb"], b["train/state_mb"])


def test_lora_on_a_sharded_base_equals_ddp(tmp_path, tiny_model_dir):
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    cli(*args(tiny_model_dir, ddp), "--nproc", "2")
    p = cli(*args(tiny_model_dir, fsdp, shard="fsdp"), "--nproc", "2")
    assert "FSDP2: 2 blocks fully_shard'ed over 2 ranks" in p.stderr
    step3 = "checkpoints/step_000003"
    assert max_diff(ddp / step3, fsdp / step3, "adapter_model.safetensors") <= 1e-5


def test_a_sigkilled_sharded_run_resumes_exactly_and_on_one_process(tmp_path, tiny_model_dir):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    full = {"finetune": "full", "shard": "fsdp"}
    cli(*args(tiny_model_dir, straight, steps=4, **full), "--nproc", "2")
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(tests) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tests / "faults.py"), "kill_in_rollout@3%0", *args(tiny_model_dir, killed, steps=4, **full)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0
    assert sorted(c.name for c in (killed / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    cli("train", "--resume", str(killed), "--nproc", "2", "--trust_task_code")
    step4 = "checkpoints/step_000004"
    assert max_diff(straight / step4, killed / step4, "model.safetensors") <= 1e-6
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == [0, 1, 1, 2, 2, 3, 3, 4, 4]  # each once
    # the sharded checkpoint (DCP shards) continues on one unsharded process, DCP resharding it
    p = cli("train", "--resume", str(killed), "--steps", "5", "--trust_task_code")
    assert (killed / "checkpoints/step_000005/model.safetensors").is_file()
    # and exports as a plain Hugging Face model with the trained policy's greedy completions
    p = cli("export", str(killed / step4), "--out", str(tmp_path / "model"), "--trust_task_code")
    assert "greedy check: 3/3" in p.stderr or "greedy check: 4/4" in p.stderr, p.stderr
    assert max_diff(killed / step4, tmp_path / "model", "model.safetensors") == 0
    # shards taken out of their run directory cannot name their base: one line, not a transformers traceback
    import shutil

    shutil.copytree(killed / step4, tmp_path / "loose")
    p = run_cli("eval", "--adapter", str(tmp_path / "loose"))
    assert p.returncode != 0 and "DCP shards of full weights, outside their run directory" in p.stderr
    assert "Traceback" not in p.stderr
    assert max_diff(killed / step4, killed / "checkpoints/step_000005", "model.safetensors") > 1e-5  # it trained
