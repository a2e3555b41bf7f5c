"""A failed sharded save (`--finetune full --shard fsdp --nproc 2`: every rank writes its DCP shard): a full disk or an
I/O error on either rank stops the run in one line (`llmrl: stopped`, printed once for both ranks), with no traceback
and no temporary checkpoint directory left, and the previous checkpoint intact: it verifies and a resume from it
ends exactly as the uninterrupted run. Run as the user runs it (`llmrl train --nproc 2`, through torchrun): the fault
reaches the ranks through the environment, which a sitecustomize.py (tests/faults.py:rank_hook) reads in each.
Then the same on a real full disk: the run directory on a tmpfs that holds the first checkpoint but not the second."""

import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import TESTS, read_jsonl, tiny_args
from llmrl.checkpoint import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow

STEPS = 2
SHARD = r"^write@.* \[__N_N\.distcp\]$"  # a rank's shard file (faults.Injector.name), whatever the code line
REASON = {"enospc": "No space left on device", "eio": "Input/output error"}


def args(model, out):
    return [*tiny_args(model, out, "grpo", steps=STEPS, finetune="full", shard="fsdp", eval_interval=0, lr="1e-3"),
            "--nproc", "2"]


def llmrl(*argv, env=None) -> subprocess.CompletedProcess:
    """`llmrl ARGV` as the user types it (`--nproc 2`: the CLI launches torchrun), with the tests on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "llmrl", *argv], capture_output=True, text=True, timeout=600, env=env)


def weights(ckpt: Path, scratch: Path) -> dict:
    """A sharded checkpoint's weights, its DCP shards consolidated (into `scratch`, outside the run directory)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(ckpt, scratch / f"{ckpt.parent.parent.name}-{ckpt.name}.pt")
    return torch.load(scratch / f"{ckpt.parent.parent.name}-{ckpt.name}.pt", weights_only=True)["model"]


def assert_resumes_exactly(run: Path, reference: Path, scratch: Path) -> None:
    """`train --resume` (2 ranks) ends with the uninterrupted run's weights (within 1e-6) and logs each step once."""
    p = llmrl("train", "--resume", str(run), "--nproc", "2", "--trust_task_code")
    assert p.returncode == 0, p.stderr[-3000:]
    last = f"checkpoints/step_{STEPS:06d}"
    a, b = weights(reference / last, scratch), weights(run / last, scratch)
    shared = a.keys() & b.keys()
    assert shared and not (a.keys() ^ b.keys()) - {"lm_head.weight"}
    assert max((a[k] - b[k]).abs().max().item() for k in shared) <= 1e-6
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [r["step"] for r in read_jsonl(reference / "metrics.jsonl")]


def assert_one_line_stop(p: subprocess.CompletedProcess, run: Path, reason: str) -> None:
    """Exit 1, one `llmrl: stopped` line (both ranks' output together) naming the cause and the intact step-1
    checkpoint, no traceback, no temporary checkpoint directory; step 1's checkpoint is the newest and verifies."""
    stops = [line for line in p.stderr.splitlines() if line.startswith("llmrl: stopped")]
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(stops) == 1, stops
    previous = run / "checkpoints" / "step_000001"
    assert reason in stops[0] and f"the previous checkpoint ({previous}) is intact" in stops[0], stops[0]
    assert "--nproc 2" in stops[0], stops[0]  # the resume command it gives runs sharded again
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert not (run / "checkpoints" / "step_000002").exists()
    assert latest_checkpoint(run) == previous and verify_checkpoint(previous) is None


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """The uninterrupted sharded run (its checkpoints also size the tmpfs)."""
    out = tmp_path_factory.mktemp("sharded") / "reference"
    p = llmrl(*args(tiny_model_dir, out))
    assert p.returncode == 0, p.stderr[-3000:]
    # from_pretrained cannot read DCP shards: the run's last line names the command that can
    assert f"model: {out / 'checkpoints' / f'step_{STEPS:06d}'} (DCP shards: `llmrl export {out}` writes a model" in p.stderr
    return out


@pytest.mark.parametrize("kind", ["enospc", "eio"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_shard_write_on_either_rank_stops_in_one_line(tmp_path, tiny_model_dir, reference, kind, rank):
    import faults

    run, fired = tmp_path / "run", tmp_path / "fired"
    hook = faults.rank_hook(tmp_path / "hook")  # PYTHONPATH's first folder: its sitecustomize.py arms each rank
    env = faults.site_env(run, tmp_path / "tmp", tmp_path / "sites", site=SHARD, rank=rank, occurrence=2, kind=kind,
                          fired=fired, pattern=True)  # rank `rank`'s second shard write: step 2's save
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(TESTS), os.environ.get("PYTHONPATH", "")])
    p = llmrl(*args(tiny_model_dir, run), env=env)
    assert fired.exists(), p.stderr[-3000:]
    assert_one_line_stop(p, run, REASON[kind])
    assert_resumes_exactly(run, reference, tmp_path / "scratch")


def pages(path: Path) -> int:
    """Bytes `path`'s files take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in path.rglob("*") if f.is_file())


@contextmanager
def tmpfs(mnt: Path, size: int):
    """A tmpfs of `size` bytes mounted on `mnt` (skips the test where one cannot be), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if not shutil.which("mount") or not shutil.which("umount"):
        pytest.skip("no mount/umount command")
    mnt.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # a process still holds a file: lazily


def test_a_real_full_disk_during_a_sharded_save(tmp_path, tiny_model_dir, reference):
    """The run directory on a tmpfs that holds the run after step 1's checkpoint and half of step 2's: step 2 stops in
    one line. The trainer checks free space before a save (checkpoint.py:space_needed, an estimate); if its estimate is
    short of what the shards take, a second tmpfs with room for the estimate but not the shards makes DCP's own writes
    hit the full disk. The kept checkpoint, copied to a disk with room, resumes exactly."""
    checkpoint = pages(reference / "checkpoints" / "step_000001")
    after_step1 = pages(reference) - pages(reference / "checkpoints" / f"step_{STEPS:06d}")
    with tmpfs(tmp_path / "mnt", after_step1 + checkpoint // 2) as mnt:
        p = llmrl(*args(tiny_model_dir, mnt / "run"))
        assert (mnt / "run" / "checkpoints" / "step_000001").is_dir(), p.stderr[-3000:]  # the first checkpoint fitted
        said = re.search(r"not enough free space for it \(([0-9.]+) MiB needed", p.stderr)
        assert_one_line_stop(p, mnt / "run", "not enough free space for it" if said else REASON["enospc"])
        shutil.copytree(mnt / "run", tmp_path / "copy")
    estimate = float(said[1]) * 2**20 if said else None
    if estimate is not None and estimate + (1 << 20) < checkpoint:  # room for the estimate, not for the shards
        with tmpfs(tmp_path / "mnt2", after_step1 + int(estimate + checkpoint) // 2) as mnt:
            p = llmrl(*args(tiny_model_dir, mnt / "run"))
            assert (mnt / "run" / "checkpoints" / "step_000001").is_dir(), p.stderr[-3000:]
            assert_one_line_stop(p, mnt / "run", REASON["enospc"])
    assert_resumes_exactly(tmp_path / "copy", reference, tmp_path / "scratch")
