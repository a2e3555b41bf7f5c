"""`make faults`: inject a fault at every write site of a short run, then resume and check that nothing was lost.

    python tests/fault_loop.py [--out DIR] [--random_kills N] [--occurrences middle|all] [--engine hf|vllm]

1. A traced run (no fault) lists the run's write sites: every file opened for writing, every rename, fsync,
   directory made and safetensors file written, under the run directory or the run's TMPDIR, named by their
   path with step numbers and temporary names folded (`write:checkpoints/.tmp-*/adapter_model.safetensors`).
2. For each site and each fault class — SIGKILL (halfway through the write, or just before a rename/fsync/mkdir),
   ENOSPC and EIO (the write stores half its bytes, then fails) — a fresh run gets that fault at the site's
   visit after the middle (step 2's for a per-step site, so a previous checkpoint exists; `--occurrences all`:
   at every visit), then `llmrl train --resume` runs it to the end.
3. A corrupt file where one is read back: the run is killed right after step 1's checkpoint, then each file a
   resume reads (every file of that checkpoint: a byte flipped in its middle; `latest`, config.yaml and
   metrics.jsonl: cut in half) is damaged in a copy and the copy is resumed.
4. SIGKILL at random moments (seeded): `--random_kills` runs killed at a uniform time within a clean run's wall time.

Invariants checked after each case: the faulted process ended by the signal, or stopped with one line on stderr
and no traceback (exit 1 for a stop, 2 for a refusal); the resume (or, when the fault came before the first
checkpoint, the same command again with --overwrite) ends with exit 0, its
final adapter equals the uninterrupted run's within 1e-6, every step is logged exactly once with the same values,
the newest checkpoint verifies; no process of the run is alive after it, no temporary or scratch file is left in
the run directory or its TMPDIR (and a refusal leaves the run directory's files as they were).

`--engine vllm` (in a venv with vLLM: `make faults-vllm`) runs the same loop with the in-process vLLM engine, at
the write sites that engine adds (its scratch adapters in the run directory; the sites it shares with hf are the
hf pass's), plus random kills; a SIGKILLed run's scratch adapters must be swept by the resume.

Each run is a fork of this process after the heavy imports (a warm start: the fault loop's cost is the runs, not
Python's start-up). It prints one line per fault class and engine and a total
`faults injected N, survived N, lost N`; a site that no fault reached is listed as uncovered. Exit 0 iff lost 0.
"""

from __future__ import annotations

import argparse
import builtins
import errno
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
os.environ.setdefault("LLMRL_CPU_DTYPE", "float32")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["HF_HUB_OFFLINE"] = "1"

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

import llmrl.cli  # noqa: E402  (imported before the forks: each run starts warm)
import llmrl.training.loop  # noqa: E402,F401
from llmrl.checkpoint import latest_checkpoint, verify_checkpoint  # noqa: E402
from llmrl.training import hooks  # noqa: E402

STEPS = 2
LLMRL_SRC = os.path.dirname(os.path.abspath(llmrl.cli.__file__))
MARKER = "LLMRL_FAULT_LOOP"  # set in every run's environment: a process that still has it afterwards was left behind
CLASSES = ("sigkill", "enospc", "eio")
ENGINE_SITE = re.compile(r"@rollout/")  # --engine vllm: the sites in the rollout engines' code (scratch adapters)
ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}


# --------------------------------------------------------------------------------------------- the injector


@dataclass
class Injector:
    """Counts the write sites of one run; with `site`, fires `kind` at that site's `occurrence`-th visit."""

    run_dir: Path
    tmp_dir: Path
    site: str | None = None
    occurrence: int = 0
    kind: str = ""
    seen: Counter = field(default_factory=Counter)
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
        return site == self.site and self.seen[site] == self.occurrence

    def fail(self, path) -> None:
        """The fault itself, at the moment it fires (after half the bytes of a write)."""
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


# --------------------------------------------------------------------------------------------- one run


@dataclass
class Outcome:
    status: str  # "ok", "signal N", "exit N"
    stderr: str
    seen: dict[str, int]
    example: dict[str, str]
    seconds: float


def run(argv: list[str], run_dir: Path, tmp_dir: Path, log: Path, *, site: str | None = None, occurrence: int = 0,
        kind: str = "", kill_after: float | None = None, after_checkpoint: int | None = None) -> Outcome:
    """`llmrl ARGV` in a forked child with the injector installed; returns how it ended and the sites it visited."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    seen_file = log.with_suffix(".sites.json")
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            os.setpgid(0, 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ[MARKER] = str(run_dir)
            os.environ["TMPDIR"] = str(tmp_dir)
            tempfile.tempdir = None
            inj = Injector(run_dir.resolve(), tmp_dir.resolve(), site, occurrence, kind)
            install(inj)
            if after_checkpoint:
                count = {"n": 0}

                def maybe_die(**info):
                    count["n"] += 1
                    if count["n"] == after_checkpoint:
                        os.kill(os.getpid(), signal.SIGKILL)

                hooks.on("after_checkpoint", maybe_die)
            try:
                code = llmrl.cli.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # a traceback is a lost case: it lands in the log, and the exit says so
                import traceback

                traceback.print_exc()
                code = 99
            sys.stdout.flush()
            sys.stderr.flush()
            with io.FileIO(str(seen_file), "w") as f:
                f.write(json.dumps({"seen": dict(inj.seen), "example": inj.example}).encode())
        finally:
            os._exit(code)
    done = (0, 0)
    if kill_after is not None:
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline and (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            time.sleep(0.02)
        if done == (0, 0):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0) if done == (0, 0) else done
    if os.WIFSIGNALED(status):
        how = f"signal {os.WTERMSIG(status)}"
    else:
        how = "ok" if os.WEXITSTATUS(status) == 0 else f"exit {os.WEXITSTATUS(status)}"
    seen = json.loads(seen_file.read_text()) if seen_file.exists() else {"seen": {}, "example": {}}
    return Outcome(how, log.read_text(errors="replace"), seen["seen"], seen["example"], time.perf_counter() - t0)


ENGINE = {"name": "hf"}  # --engine: set once in main(), before any run


def train_args(model: str, out: Path) -> list[str]:
    """A short run on the tiny model that reaches every kind of write: a checkpoint each step (two kept), samples,
    an eval at step 2 and the end, the report. toy_task's reward varies, so the adapter moves every step."""
    from helpers import tiny_args

    return tiny_args(model, out, "grpo", steps=STEPS, eval_interval=2, eval_n=2, save_interval=1, keep_checkpoints=2,
                     rollout_engine=ENGINE["name"])


MISSED = "missed"  # a random kill that came after its run had ended: nothing was injected
RESUME = ["--task", "toy_task:CharTask"]  # naming the task's code again: a resume never imports it unasked


def in_child(fn) -> int:
    """Run `fn()` in a forked child (this process stays free of torch's thread pools, so later forks are safe)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


# --------------------------------------------------------------------------------------------- invariants


COMPILE_FILES = {".hpp", ".h", ".cpp", ".so", ".o", ".lock", ".json", ".tmp", ".py"}


def torch_compile_files(p: Path) -> bool:
    """What torch's inductor puts in TMPDIR while vLLM's CPU kernels compile (its cache `torchinductor_USER`, and
    a `tmpXXXX` folder of C++ sources and objects per compile, which a SIGKILL mid-compile leaves): torch's
    files, not llmrl's (llmrl's own scratch lives in the run directory)."""
    if p.name.startswith("torchinductor_"):
        return True
    return p.is_dir() and p.name.startswith("tmp") and all(
        f.suffix in COMPILE_FILES for f in p.rglob("*") if f.is_file())


def leftovers(run_dir: Path, tmp_dir: Path, files: bool = True) -> list[str]:
    """Processes still carrying this run's marker, and (`files`) temporary files left in the run directory or
    TMPDIR: a killed process cannot sweep its own, so files are checked after the resume that must sweep them."""
    found = []
    deadline = time.monotonic() + 5.0  # children told to die with their parent get a moment to go
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{MARKER}={run_dir}".encode() + b"\0" in f.read():
                        alive.append(entry)
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    found += [f"process {p} still running" for p in alive]
    for p in alive:
        try:
            os.kill(int(p), signal.SIGKILL)
        except OSError:
            pass
    if files and tmp_dir.exists():
        found += [f"TMPDIR/{p.name} left" for p in tmp_dir.iterdir() if not torch_compile_files(p)]
    if files and run_dir.exists():
        found += [f"{p.relative_to(run_dir)} left" for p in run_dir.rglob("*") if re.search(r"\.tmp|~$", p.name)]
    return found


def one_line_stop(o: Outcome, codes: tuple[str, ...]) -> str | None:
    """None when `o` ended by SIGKILL, or with one of `codes` and exactly one `llmrl:` line and no traceback."""
    if o.status == f"signal {signal.SIGKILL}":
        return None
    if o.status not in codes:
        return f"ended with {o.status}: {o.stderr.strip().splitlines()[-1:] if o.stderr.strip() else ''}"
    if "Traceback" in o.stderr:
        return "a traceback: " + o.stderr.strip().splitlines()[-1][:200]
    lines = [ln for ln in o.stderr.splitlines() if ln.startswith("llmrl: stopped") or ln.startswith("llmrl: error")]
    if len(lines) != 1:
        return f"{len(lines)} stop lines"
    return None


def same_run(reference: Path, run_dir: Path) -> str | None:
    """None when the final adapter (within 1e-6), the logged steps (each once) and their values match."""
    from helpers import assert_same_run

    try:
        assert_same_run(reference, run_dir, STEPS)
    except (AssertionError, OSError, KeyError, ValueError) as e:
        return f"differs from the uninterrupted run: {str(e)[:200] or type(e).__name__}"
    newest = latest_checkpoint(run_dir, report=lambda msg: None)
    if newest is None or verify_checkpoint(newest) is not None:
        return f"newest checkpoint does not verify: {newest}"
    return None


def files_of(run_dir: Path) -> dict[str, bytes]:
    """The run's files and their bytes, but the lock (a refused resume may have held it: it writes its pid there)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# --------------------------------------------------------------------------------------------- the loop


@dataclass
class Tally:
    results: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    lost: list[str] = field(default_factory=list)
    missed: int = 0

    def add(self, cls: str, engine: str, name: str, problem: str | None) -> None:
        if problem == MISSED:
            self.missed += 1
            return
        r = self.results[(cls, engine)]
        r[0] += 1
        if problem is None:
            r[1] += 1
        else:
            self.lost.append(f"{cls}[{engine}] {name}: {problem}")
            print(f"  LOST {cls}[{engine}] {name}: {problem}", flush=True)


def fault_then_resume(work: Path, model: str, reference: Path, **fault) -> str | None:
    """One case: a faulted run into work/run, then a resume; the first invariant it breaks, or None."""
    run_dir, tmp_dir = work / "run", work / "tmp"
    o = run(train_args(model, run_dir), run_dir, tmp_dir, work / "fault.log", **fault)
    if o.status == "ok" and fault.get("kill_after") is not None:
        return MISSED  # the run was faster than the reference: the kill came after it ended
    problem = one_line_stop(o, ("exit 1", "exit 2"))  # 2: a set-up write failed (`output_dir ... is not writable`)
    if problem:
        return f"faulted run {problem} (log {work / 'fault.log'})"
    left = leftovers(run_dir, tmp_dir, files=False)
    if left:
        return f"after the fault: {', '.join(left[:3])}"
    # a fault before the first checkpoint left nothing to resume: the user runs the same command again
    # (what the refusal of `--resume` says: with --overwrite)
    again = ["train", "--resume", str(run_dir), *RESUME] if latest_checkpoint(run_dir, report=lambda _: None) \
        else [*train_args(model, run_dir), "--overwrite"]
    r = run(again, run_dir, tmp_dir, work / "resume.log")
    if r.status != "ok":
        return f"resume {r.status}: {r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else ''}"
    return same_run(reference, run_dir) or (", ".join(leftovers(run_dir, tmp_dir)[:3]) or None)


def damage_then_resume(work: Path, base: Path, target: Path, damage: str, reference: Path) -> str | None:
    """One case: a copy of the killed run `base` with `target` damaged, resumed; the first broken invariant."""
    shutil.copytree(base, work)
    victim = work / "run" / target.relative_to(base / "run")
    data = bytearray(victim.read_bytes())
    if damage == "flip" and data:
        data[len(data) // 2] ^= 0x55
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    before = files_of(work / "run")
    r = run(["train", "--resume", str(work / "run"), *RESUME], work / "run", work / "tmp", work / "resume.log")
    if r.status == "exit 2":  # refused: one line, and the run directory untouched
        problem = one_line_stop(r, ("exit 2",)) or (
            None if files_of(work / "run") == before else "a refusal changed the run directory")
    elif r.status == "ok":
        problem = same_run(reference, work / "run")
    else:
        problem = f"resume {r.status}: {r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else ''}"
    return problem or (", ".join(leftovers(work / "run", work / "tmp")[:3]) or None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="working directory (default: a temporary one, removed when nothing is lost)")
    ap.add_argument("--random_kills", type=int, default=6)
    ap.add_argument("--occurrences", choices=("middle", "all"), default="middle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="cases run side by side")
    ap.add_argument("--list", action="store_true", help="only list the write sites of the uninterrupted run")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="rollout engine (vllm: only the write sites it adds, see above)")
    args = ap.parse_args()
    ENGINE["name"] = engine = args.engine
    out = Path(args.out or tempfile.mkdtemp(prefix="llmrl-faults-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from conftest import save_tiny_llama
    from llmrl.models.loading import resolve_model_path

    model = str(out / "model")
    shape = dict(hidden=32, intermediate=64, heads=4, kv_heads=2, positions=256) if engine == "hf" else \
        dict(hidden=128, intermediate=256, heads=2, kv_heads=1, positions=512)  # vLLM's CPU attention: head_dim 64
    if not (out / "model" / "config.json").exists() and in_child(lambda: save_tiny_llama(
            out / "model", resolve_model_path("smollm2-135m-instruct"), **shape)) != 0:
        print("could not build the tiny model")
        return 1
    shutil.rmtree(out / "reference", ignore_errors=True)
    reference = out / "reference" / "run"
    ref = run(train_args(model, reference), reference, out / "reference" / "tmp", out / "reference.log")
    if ref.status != "ok":
        print(f"the uninterrupted run failed ({ref.status}); see {out / 'reference.log'}")
        return 1
    sites = ref.seen
    print(f"uninterrupted run: {STEPS} steps in {ref.seconds:.1f} s; {len(sites)} write sites in llmrl's code, "
          f"{sum(sites.values())} writes", flush=True)
    if args.list:
        for site, count in sorted(sites.items()):
            print(f"  {site} ×{count} ({ref.example[site]})")
        return 0

    # vllm: the engine's own sites in the run directory; its code also calls into vLLM and torch, which write their
    # kernel compiles to TMPDIR (and tolerate a failed write there): those are listed, not faulted
    own = sorted(sites) if engine == "hf" else [site for site in sorted(sites) if ENGINE_SITE.search(site)
                                                 and not ref.example[site].startswith("..")]
    cases = []  # (class, name, work folder, the case as a function of its folder)
    for site, count in ((site, sites[site]) for site in own):
        for occ in range(1, count + 1) if args.occurrences == "all" else [count // 2 + 1]:
            for cls in CLASSES:
                cases.append((cls, f"{site}#{occ}", lambda w, site=site, occ=occ, cls=cls: fault_then_resume(
                    w, model, reference, site=site, occurrence=occ, kind=cls)))
    rng = random.Random(args.seed)
    for at in sorted(rng.uniform(0.1, 0.9) * ref.seconds for _ in range(args.random_kills)):
        cases.append(("random-sigkill", f"at {at:.1f} s",
                      lambda w, at=at: fault_then_resume(w, model, reference, kill_after=at)))
    # a corrupt file where one is read back: the run killed right after step 1's checkpoint, then one file damaged
    # (the files a resume reads are the same whichever engine wrote them: the hf pass's)
    base = out / "killed-after-step1"
    shutil.rmtree(base, ignore_errors=True)
    o = run(train_args(model, base / "run"), base / "run", base / "tmp", out / "killed-after-step1.log",
            after_checkpoint=1)
    newest = latest_checkpoint(base / "run", report=lambda msg: None)
    if engine != "hf":
        pass
    elif o.status != f"signal {signal.SIGKILL}" or newest is None:
        cases.append(("corrupt", "setup", lambda w: f"the run to damage ended with {o.status}"))
    else:
        targets = [p for p in sorted(newest.iterdir()) if p.is_file()]
        targets += [p for p in (base / "run" / "checkpoints" / "latest", base / "run" / "config.yaml",
                                base / "run" / "metrics.jsonl") if p.exists()]
        for target in targets:  # a checkpoint's files rot (a byte flipped); the others are cut short by a crash
            damage = "flip" if target.parent == newest else "cut"
            cases.append(("corrupt", f"{damage} {target.relative_to(base / 'run')}",
                          lambda w, t=target, d=damage: damage_then_resume(w, base, t, d, reference)))
    print(f"{len(cases)} cases, {args.jobs} at a time", flush=True)

    def one(i_case):
        i, (cls, name, fn) = i_case
        work = out / f"case{i:03d}"
        shutil.rmtree(work, ignore_errors=True)
        problem = fn(work)
        if problem is None:
            shutil.rmtree(work, ignore_errors=True)
        return cls, name, problem

    from concurrent.futures import ThreadPoolExecutor

    tally = Tally()
    with ThreadPoolExecutor(args.jobs) as pool:
        for cls, name, problem in pool.map(one, enumerate(cases)):
            tally.add(cls, engine, name, problem)

    for (cls, eng), (injected, survived) in sorted(tally.results.items()):
        print(f"{cls}[{eng}]: injected {injected}, survived {survived}, lost {injected - survived}")
    reached = {name.rsplit("#", 1)[0] for cls, name, _ in cases if cls in CLASSES}
    uncovered = sorted(set(own) - reached)
    print(f"write sites: {len(sites)}" + (f", the {engine} engine's own: {len(own)}" if engine != "hf" else "")
          + f", covered {len(own) - len(uncovered)}" + (f", uncovered: {', '.join(uncovered)}" if uncovered else ""))
    for site, count in sorted(sites.items()):
        print(f"  {site} ×{count} ({ref.example[site]})" + ("" if site in own else " (torch's, in TMPDIR: not faulted)"
                                                              if ref.example[site].startswith("..") else " (the hf pass's)"))
    if tally.missed:
        print(f"random kills that came after their run had ended (not counted): {tally.missed}")
    print({"hf": "engines not run here: vllm (make faults-vllm), vllm-server",
           "vllm": "engines not run here: hf (make faults), vllm-server"}[engine])
    injected = sum(r[0] for r in tally.results.values())
    survived = sum(r[1] for r in tally.results.values())
    print(f"faults injected {injected}, survived {survived}, lost {injected - survived} "
          f"({time.perf_counter() - t0:.0f} s)")
    if not tally.lost and not args.out:
        shutil.rmtree(out, ignore_errors=True)
    elif tally.lost:
        print(f"kept {out}")
    return 0 if not tally.lost else 1


if __name__ == "__main__":
    sys.exit(main())
