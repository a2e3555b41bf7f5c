"""The names of the files and folders a run directory holds (one place: trainer, logger, report), how a
file in it is replaced whole, and where llmrl's own cache lives (converted models, kernel verdicts)."""

import errno
import os
from pathlib import Path

def cache_root() -> Path:
    """Where converted models and measured kernel verdicts live: $LLMRL_CACHE, else ~/.cache/llmrl."""
    return Path(os.environ.get("LLMRL_CACHE", Path.home() / ".cache" / "llmrl"))


CONFIG = "config.yaml"  # the resolved config
DATA_REPORT = "data_report.json"  # math_hard: problems kept and dropped, by reason
METRICS = "metrics.jsonl"  # one object per RL step and per eval
SAMPLES = "samples.jsonl"  # training completions, appended
EVAL_SAMPLES = "eval_samples.jsonl"  # eval completions, appended
CHECKPOINTS = "checkpoints"  # step_NNNNNN/ folders and the `latest` pointer
LATEST = "latest"  # in CHECKPOINTS: the name of the newest complete checkpoint
REPORT = "report.html"
PLOTS = "plots"
TENSORBOARD = "tensorboard"
SCRATCH = ".tmp-adapters-"  # + PID-XXXX: a vLLM engine's scratch adapters (rollout/base.scratch_dir)
LOCK = ".lock"  # the pid of the trainer writing the run, flock'ed while it runs (not part of the run)

RUN_FILES = (CONFIG, DATA_REPORT, METRICS, SAMPLES, EVAL_SAMPLES, CHECKPOINTS, REPORT, PLOTS, TENSORBOARD)

DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})  # a write failed for the disk's sake


def candidates(run_dir: Path) -> list[Path]:
    """Checkpoint directories, the one `latest` names first, then newest to oldest (checkpoint.latest_checkpoint
    verifies them)."""
    root = run_dir / CHECKPOINTS
    if not root.exists():
        return []
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.exists() else None
    return ([named] if named in found else []) + [p for p in found if p != named]


def fsync_path(path: Path) -> None:
    """Flush a file or directory to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: str | bytes) -> None:
    """Replace `path` by `data` through a flushed temporary file and a rename: a kill or a full disk leaves the
    old file or the new one, never a part. An OSError names `path` (its filename)."""
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")  # the pid: `llmrl report` may write beside a trainer
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        e.filename = str(path)
        raise
