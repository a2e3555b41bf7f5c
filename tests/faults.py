"""Run the real `llmrl` CLI in this process with one injected fault, for the fault-injection tests.

    python tests/faults.py FAULT@N llmrl-args...

FAULT@N fires on the N-th occurrence in this process:
  kill_in_rollout  SIGKILL at the start of the N-th rollout
  kill_in_save     SIGKILL in the N-th checkpoint save, after the adapter and optimizer are written
  kill_after_save  SIGKILL right after the N-th checkpoint is complete
  kill_in_log      SIGKILL after writing half of the N-th metrics line
  enospc_in_save   the N-th checkpoint save fails with "No space left on device" (writing rng.pt)
  enospc_in_adapter  the N-th adapter write fails as safetensors fails on a full disk (SafetensorError)
  eio_in_save      the N-th checkpoint save fails with an I/O error (EIO) writing its manifest.json
  eio_in_latest    the N-th rewrite of checkpoints/latest fails with EIO (the checkpoint itself is complete)
  enospc_in_log    the N-th metrics.jsonl append writes half its line, then fails with ENOSPC
  eio_in_samples   the N-th samples.jsonl append writes half its rows, then fails with EIO
  eio_in_report    the N-th report refresh fails with EIO
  slow_rollout     every rollout first sleeps one second (N unused)
  kill_server      SIGKILL to the vLLM server process (vllm-server engine; not its engine processes) at the start of
                   the N-th rollout
  replies_end      every hf reply ends with EOS at its N-th token (the random tiny model never picks EOS:
                   multi-turn episodes then reach their environment)
FAULT@N%R fires only in the process whose RANK is R (under torchrun).
"""

import errno
import os
import signal
import sys
import time

import peft.peft_model
import safetensors

import llmrl.checkpoint
import llmrl.logger
import llmrl.report
from llmrl.cli import main
from llmrl.run_files import METRICS, SAMPLES
from llmrl.training import hooks


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_servers() -> None:
    """SIGKILL every vLLM server this process started (only the server: what became of its engine processes is
    for the trainer to clean up)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"vllm.entrypoints.openai.api_server" in cmdline:
            os.kill(int(entry), signal.SIGKILL)


class HalfThenFail:
    """A file opened for appending whose write stores half its text, then fails with `code`."""

    def __init__(self, f, code: int):
        self.f, self.code = f, code

    def write(self, text: str) -> int:
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise OSError(self.code, os.strerror(self.code))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def inject(fault: str, n: int) -> None:
    count = {"n": 0}

    def hit() -> bool:
        count["n"] += 1
        return count["n"] == n

    if fault == "kill_in_rollout":
        hooks.on("before_rollout", lambda **info: die() if hit() else None)
    elif fault in ("kill_in_save", "enospc_in_save", "eio_in_save"):
        real_write = llmrl.checkpoint._write
        target = "manifest.json" if fault == "eio_in_save" else "rng.pt"

        def write(path, data):
            if path.name == target and hit():
                if fault == "kill_in_save":
                    die()
                code = errno.EIO if fault == "eio_in_save" else errno.ENOSPC
                raise OSError(code, os.strerror(code))
            return real_write(path, data)

        llmrl.checkpoint._write = write
    elif fault == "enospc_in_adapter":
        real_save_file = peft.peft_model.safe_save_file

        def save_file(tensors, filename, *a, **k):
            if hit():
                with open(filename, "wb") as f:
                    f.write(b"\0" * 64)  # what a full disk leaves: a torn file
                raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_save_file(tensors, filename, *a, **k)

        peft.peft_model.safe_save_file = save_file
    elif fault == "eio_in_latest":
        real_atomic = llmrl.checkpoint.write_atomically

        def write_atomically(path, data):
            if path.name == llmrl.checkpoint.LATEST and hit():
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
            return real_atomic(path, data)

        llmrl.checkpoint.write_atomically = write_atomically
    elif fault in ("enospc_in_log", "eio_in_samples"):
        target, code = (METRICS, errno.ENOSPC) if fault == "enospc_in_log" else (SAMPLES, errno.EIO)

        def open_for_log(file, mode="r", *a, **k):
            f = open(file, mode, *a, **k)
            return HalfThenFail(f, code) if str(file).endswith(target) and "a" in mode and hit() else f

        llmrl.logger.open = open_for_log  # the logger's own `open`, not the builtin
    elif fault == "eio_in_report":
        real_report = llmrl.report.write_report

        def write_report(run_dirs, out_dir, *a, **k):
            if hit():
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(out_dir / "report.html"))
            return real_report(run_dirs, out_dir, *a, **k)

        llmrl.report.write_report = write_report
    elif fault == "kill_after_save":
        hooks.on("after_checkpoint", lambda **info: die() if hit() else None)
    elif fault == "kill_in_log":
        real_append = llmrl.logger.RunLogger._append

        def _append(self, file, rows):
            if file == METRICS and hit():
                with open(self.run_dir / file, "a") as f:
                    f.write('{"step": 99, "reward/me')
                    f.flush()
                die()
            return real_append(self, file, rows)

        llmrl.logger.RunLogger._append = _append
    elif fault == "kill_server":
        hooks.on("before_rollout", lambda **info: kill_servers() if hit() else None)
    elif fault == "slow_rollout":
        hooks.on("before_rollout", lambda **info: time.sleep(1.0))
    elif fault == "replies_end":
        from helpers import stop_after
        from transformers import AutoTokenizer

        from llmrl.rollout import hf as hf_engine

        model = sys.argv[sys.argv.index("--model") + 1]
        hf_engine.KeyedSampler = stop_after(n, AutoTokenizer.from_pretrained(model).eos_token_id)
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault}")


if __name__ == "__main__":
    name, _, at = sys.argv[1].partition("@")
    at, _, only_rank = at.partition("%")
    if not only_rank or only_rank == os.environ.get("RANK", "0"):
        inject(name, int(at or 1))
    sys.exit(main(sys.argv[2:]))
