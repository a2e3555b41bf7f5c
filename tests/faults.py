"""Run the real `llmrl` CLI in this process with one injected fault, for the fault-injection tests.

    python tests/faults.py FAULT@N llmrl-args...

FAULT@N fires on the N-th occurrence in this process:
  kill_in_rollout  SIGKILL at the start of the N-th rollout
  kill_in_save     SIGKILL in the N-th checkpoint save, after the adapter and optimizer are written
  kill_after_save  SIGKILL right after the N-th checkpoint is complete
  kill_in_log      SIGKILL after writing half of the N-th metrics line
  enospc_in_save   the N-th checkpoint save fails with "No space left on device"
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

import torch

import llmrl.checkpoint
import llmrl.logger
from llmrl.cli import main
from llmrl.run_files import METRICS
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


def inject(fault: str, n: int) -> None:
    count = {"n": 0}

    def hit() -> bool:
        count["n"] += 1
        return count["n"] == n

    if fault == "kill_in_rollout":
        hooks.on("before_rollout", lambda **info: die() if hit() else None)
    elif fault in ("kill_in_save", "enospc_in_save"):
        real_save = torch.save

        def save(obj, f, *a, **k):
            if str(f).endswith("rng.pt") and hit():
                if fault == "kill_in_save":
                    die()
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, f, *a, **k)

        llmrl.checkpoint.torch.save = save
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
