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

The fault loop's write-site injector (tests/fault_loop.py) lives here too: `Injector` and `install` route a process's
writes (open for writing, renames, fsync, mkdir, safetensors and torch files) through one injector; `rank_hook`
makes a sitecustomize.py folder that installs it in every torchrun rank from the environment (LLMRL_FAULT_SITE, one
rank addressed as FAULT%RANK is above), for runs that are not forks of the loop (`--nproc 2`).
"""

import atexit
import builtins
import errno
import io
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import peft.peft_model
import safetensors
import safetensors.torch
import torch

import llmrl.checkpoint
import llmrl.cli
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


# --------------------------------------------------------------------------------------------- the write-site injector

LLMRL_SRC = os.path.dirname(os.path.abspath(llmrl.cli.__file__))
ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}
SITE_ENV = "LLMRL_FAULT_SITE"  # a torchrun rank's injector, as JSON (rank_hook)


@dataclass
class Injector:
    """Counts the write sites of one run; with `site`, fires `kind` at that site's `occurrence`-th visit (`site` a
    regular expression with `pattern`: at the `occurrence`-th visit of any site it finds, e.g. r"\[__N_N\.distcp\]",
    for a test that does not trace the run first). `fired`: a file made (outside the run) the moment the fault fires,
    so the caller knows it did."""

    run_dir: Path
    tmp_dir: Path
    site: str | None = None
    occurrence: int = 0
    kind: str = ""
    fired: str | None = None
    pattern: bool = False
    seen: Counter = field(default_factory=Counter)
    matched: int = 0  # visits of the sites `site` finds (pattern)
    example: dict[str, str] = field(default_factory=dict)  # a path written at each site, for the listing

    @property
    def roots(self) -> tuple[str, str]:
        return str(self.run_dir), str(self.tmp_dir)

    def name(self, op: str, path) -> str | None:
        """The write site: `op@file:line` of the innermost llmrl frame that asked for it (one place in the code,
        whichever file it writes, so a loop over files is one site); None for paths outside the run's folders."""
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return None
        if not any(p == root or p.startswith(root + os.sep) for root in self.roots):
            return None
        if f"{os.sep}torchinductor_" in p:  # torch's compile cache (vLLM compiles CPU kernels): shared by every run,
            return None  # written by torch, which treats a failed cache write as a cache miss; not llmrl's
        frame = sys._getframe(2)
        while frame is not None and (LLMRL_SRC not in frame.f_code.co_filename):
            frame = frame.f_back
        where = "outside llmrl" if frame is None else \
            f"{os.path.relpath(frame.f_code.co_filename, LLMRL_SRC)}:{frame.f_lineno}"
        # a write or rename: which file (a temporary by the file it stands for: .tmp-config.yaml.PID is config.yaml's);
        # an fsync or mkdir: the code site alone (one loop over a checkpoint's files is one site)
        base = "" if op in ("fsync", "mkdir") or p in self.roots else \
            re.sub(r"^\.tmp-(.*?)(\.[0-9]+)?$", r"\1 (temporary)", os.path.basename(p))
        base = "*.png" if ".png" in base else re.sub(r"[0-9]+", "N", base)  # the report's plots: one site
        site = f"{op}@{where}" + (f" [{base}]" if base else "")
        self.example.setdefault(site, os.path.relpath(p, str(self.run_dir)))
        return site

    def visit(self, op: str, path) -> bool:
        """Count a visit; True when the fault fires here."""
        site = self.name(op, path)
        if site is None:
            return False
        self.seen[site] += 1
        if self.pattern and self.site and re.search(self.site, site):
            self.matched += 1
            return self.matched == self.occurrence
        return site == self.site and self.seen[site] == self.occurrence

    def fail(self, path) -> None:
        """The fault itself, at the moment it fires (after half the bytes of a write)."""
        if self.fired:
            os.close(os.open(self.fired, os.O_WRONLY | os.O_CREAT, 0o644))
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        code = ERRNO[self.kind]
        raise OSError(code, os.strerror(code), os.fspath(path))


class HalfWrite:
    """Stands in for a file opened for writing at the faulted site: its first write stores half the bytes,
    then the fault fires (a close without any write fires it too)."""

    def __init__(self, f, injector: Injector, path) -> None:
        self.f, self.injector, self.path, self.fired = f, injector, path, False

    def write(self, data):
        if not self.fired:
            self.fired = True
            half = len(data) // 2
            self.f.write(data[:half])
            self.f.flush()
            self.injector.fail(self.path)
        return self.f.write(data)

    def close(self):
        if not self.fired:
            self.fired = True
            self.f.close()
            self.injector.fail(self.path)
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def install(inj: Injector) -> None:
    """Route the run's writes through `inj`: open for writing, renames, fsync, mkdir, safetensors and torch files."""
    real_open, real_replace, real_rename = builtins.open, os.replace, os.rename
    real_fsync, real_mkdir, real_serialize = os.fsync, os.mkdir, safetensors.torch.serialize_file
    real_torch_save = torch.save

    def opened(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if isinstance(file, int) or not any(c in mode for c in "wax+"):
            return f
        return HalfWrite(f, inj, file) if inj.visit("write", file) else f

    def replace(src, dst, *a, **k):
        if inj.visit("rename", dst):
            inj.fail(dst)
        return real_replace(src, dst, *a, **k)

    def rename(src, dst, *a, **k):
        if inj.visit("rename", dst):
            inj.fail(dst)
        return real_rename(src, dst, *a, **k)

    def fsync(fd):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else fd.name
        except OSError:
            path = None
        if path is not None and inj.visit("fsync", path):
            inj.fail(path)
        return real_fsync(fd)

    def mkdir(path, *a, **k):  # a directory that exists fails with EEXIST before the disk is asked: not a site
        if not os.path.lexists(path) and inj.visit("mkdir", path):
            inj.fail(path)
        return real_mkdir(path, *a, **k)

    def serialize(tensors, filename, *a, **k):
        if inj.visit("write", filename):
            with real_open(filename, "wb") as f:
                f.write(b"\0" * 64)  # a torn file: what a full disk leaves
            if inj.fired:
                os.close(os.open(inj.fired, os.O_WRONLY | os.O_CREAT, 0o644))
            if inj.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            code = ERRNO[inj.kind]
            raise safetensors.SafetensorError(f"Error while serializing: IoError({os.strerror(code)} (os error {code}))")
        return real_serialize(tensors, filename, *a, **k)

    def torch_save(obj, f, *a, **k):  # torch writes a path from C++, past `open`
        if isinstance(f, (str, os.PathLike)) and inj.visit("write", f):
            buf = io.BytesIO()
            real_torch_save(obj, buf, *a, **k)
            with real_open(f, "wb") as fh:
                fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            inj.fail(f)
        return real_torch_save(obj, f, *a, **k)

    builtins.open = io.open = opened
    torch.save = torch_save
    os.replace, os.rename, os.fsync, os.mkdir = replace, rename, fsync, mkdir
    safetensors.torch.serialize_file = serialize


def save_seen(inj: Injector, path: str) -> None:
    """The sites `inj` saw and an example path of each, as JSON (written past the injector)."""
    with io.FileIO(path, "w") as f:
        f.write(json.dumps({"seen": dict(inj.seen), "example": inj.example}).encode())


def site_env(run_dir: Path, tmp_dir: Path, seen: Path, site: str | None = None, rank: int | None = None,
             occurrence: int = 0, kind: str = "", fired: Path | None = None, pattern: bool = False) -> dict[str, str]:
    """The environment that has rank_hook's sitecustomize install an injector in every torchrun rank: each counts its
    sites into `seen`.rankR.json at exit; with `site` (a regular expression with `pattern`), rank `rank` (None: every
    rank) fires `kind` there."""
    spec = {"run_dir": str(run_dir), "tmp_dir": str(tmp_dir), "seen": str(seen), "site": site, "rank": rank,
            "occurrence": occurrence, "kind": kind, "fired": str(fired) if fired else None, "pattern": pattern}
    return {SITE_ENV: json.dumps(spec)}


def install_from_env() -> None:
    """In a torchrun rank (RANK set) whose environment names an injector (site_env): install it. The variable is
    taken out of the environment, so the processes this rank starts get none."""
    spec = json.loads(os.environ.pop(SITE_ENV))
    rank = int(os.environ["RANK"])
    mine = spec["rank"] is None or spec["rank"] == rank
    inj = Injector(Path(spec["run_dir"]).resolve(), Path(spec["tmp_dir"]).resolve(), spec["site"] if mine else None,
                   spec["occurrence"], spec["kind"], spec["fired"], spec.get("pattern", False))
    install(inj)
    atexit.register(save_seen, inj, f"{spec['seen']}.rank{rank}.json")


SITECUSTOMIZE = f"""# made by tests/faults.py:rank_hook: the fault loop's injector in every torchrun rank
import os
if os.environ.get({SITE_ENV!r}) and "RANK" in os.environ:
    import sys
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    import faults
    faults.install_from_env()
"""


def rank_hook(folder: Path) -> Path:
    """`folder` holding a sitecustomize.py that, first on PYTHONPATH, installs site_env's injector in every torchrun
    rank (Python imports sitecustomize at start-up: before `-m llmrl` runs); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


if __name__ == "__main__":
    name, _, at = sys.argv[1].partition("@")
    at, _, only_rank = at.partition("%")
    if not only_rank or only_rank == os.environ.get("RANK", "0"):
        inject(name, int(at or 1))
    sys.exit(main(sys.argv[2:]))
