"""TensorBoard scalars for a run (`--tensorboard`): the same metric names as metrics.jsonl.

Only numbers are written; None, NaN/inf, bools and strings are skipped (TensorBoard has no use for
them). Needs the optional `tensorboard` package, imported only when a logger is made.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmrl.errors import ConfigError


def scalar(value: Any) -> float | None:
    """A finite float, or None for anything TensorBoard should not get."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class TensorBoardLogger:
    """Writes scalars to event files under `log_dir` (one per process start; TensorBoard merges them)."""

    def __init__(self, log_dir: Path):
        try:
            import tensorboard  # noqa: F401 - SummaryWriter's own import error is less clear
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Add every numeric, finite metric as a scalar at `step`."""
        for name, value in metrics.items():
            if name != "step" and (v := scalar(value)) is not None:
                self.writer.add_scalar(name, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
