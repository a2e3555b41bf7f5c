"""Run logging: `metrics.jsonl` (one object per RL step, plus eval records), `samples.jsonl` and
`eval_samples.jsonl` (appended, never overwritten), and wandb / TensorBoard when asked for (same
metric names).

Only rank 0 writes; other ranks get a logger whose methods do nothing. A write that fails (a full disk, an
I/O error) does not raise where it happens: the logger records it in `failed`, writes nothing more, and the
training loop, which checks `failed` after each step's logs on every rank, stops in one line (at the last complete
checkpoint when a step's rows were lost, so the resume logs each step once; after saving when only the report failed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmrl.errors import DataError
from llmrl.run_files import EVAL_SAMPLES, METRICS, SAMPLES, TENSORBOARD, fsync_path, write_atomically


def plain(value: Any) -> Any:
    """NumPy and torch scalars and arrays (a custom task's reward, answers or evaluate may hold them) as Python
    numbers and lists, through dicts, lists and tuples; anything else as it is."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _clean(value: Any) -> Any:
    """A value as JSON can hold it: NumPy/torch numbers as plain ones, NaN/inf (which JSON lacks) as null,
    through dicts and lists; json.dumps writes anything else it cannot as its str()."""
    value = plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k): _clean(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_clean(v) for v in value]
    return value


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # e.g. a line cut short by a kill


def truncate_after(path: Path, step: int) -> None:
    """Drop records logged after `step`, and any partial line (a resumed run logs those steps again,
    so each step appears once). The file is replaced atomically."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if (s := _step_of(line)) is not None and s <= step]
    write_atomically(path, "".join(line + "\n" for line in kept))


LOGS = (METRICS, SAMPLES, EVAL_SAMPLES)  # appended each step; a checkpoint records how long each was


def check_log_sizes(run_dir: Path, sizes: dict[str, int], checkpoint: str) -> None:
    """A resumed run's logs must hold at least what they held when `checkpoint` was saved (the logs are flushed
    to disk before each checkpoint, so a crash cannot shorten them): a shorter one lost records that no resume
    can bring back, and is refused in one line rather than continued with a hole."""
    for file, size in sizes.items():
        have = (run_dir / file).stat().st_size if (run_dir / file).exists() else 0
        if have < size:
            raise DataError(f"{run_dir / file} holds {have} bytes, fewer than the {size} it held when {checkpoint} "
                            "was saved: records were lost (the file was damaged or cut); restore it, then resume")


class RunLogger:
    def __init__(self, run_dir: Path, config: dict[str, Any], *, enabled: bool = True, use_wandb: bool = False,
                 project: str = "llmrl", name: str | None = None, resume_step: int | None = None,
                 use_tensorboard: bool = False):
        self.run_dir, self.enabled = run_dir, enabled
        self.failed: str | None = None  # the first write that failed: "could not write PATH: REASON"
        self.lost_rows = False  # a metrics/samples write failed: some step's records are not on disk
        self.wandb = None
        self.tensorboard = None
        if not enabled:
            return
        if use_tensorboard:
            from llmrl.tensorboard_log import TensorBoardLogger

            self.tensorboard = TensorBoardLogger(run_dir / TENSORBOARD)
        if resume_step is not None:
            for file in LOGS:
                truncate_after(run_dir / file, resume_step)
        if use_wandb:
            import wandb

            self.wandb = wandb.init(project=project, name=name or run_dir.name, config=config, dir=str(run_dir),
                                    resume="allow")

    def durable_sizes(self) -> dict[str, int]:
        """Flush the logs to disk and return their sizes, for the checkpoint about to be written (rank 0)."""
        sizes = {}
        for file in LOGS:
            path = self.run_dir / file
            if path.exists():
                fsync_path(path)
                sizes[file] = path.stat().st_size
        return sizes

    def fail(self, path: Path | str, error: OSError) -> None:
        """Record a failed write (the first one counts) and write nothing more."""
        if self.failed is None:
            self.failed = f"could not write {path}: {error.strerror or error}"

    def _append(self, file: str, rows: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(_clean(row), default=str) + "\n" for row in rows)
        try:
            with open(self.run_dir / file, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            self.fail(self.run_dir / file, e)
            self.lost_rows = True

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one metrics record for `step` (train or eval keys)."""
        if not self.enabled or self.failed:
            return
        metrics = {k: plain(v) for k, v in metrics.items()}
        self._append(METRICS, [{"step": step, **metrics}])
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.tensorboard is not None:
            try:
                self.tensorboard.log(metrics, step)
            except OSError as e:
                self.fail(self.run_dir / TENSORBOARD, e)

    def log_samples(self, step: int, rows: list[dict[str, Any]], eval: bool = False) -> None:
        """Append a table of completions (each row gets the step); wandb gets a table per step."""
        if not self.enabled or not rows or self.failed:
            return
        self._append(EVAL_SAMPLES if eval else SAMPLES, [{"step": step, **r} for r in rows])
        if self.wandb is not None:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=columns, data=[[json.dumps(r[c]) if isinstance(r[c], dict) else r[c] for c in columns] for r in rows])
            self.wandb.log({f"{'eval' if eval else 'train'}/samples_step_{step:06d}": table}, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
