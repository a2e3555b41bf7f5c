"""`make faults`: inject a fault at every write site of a short run, then resume and check that nothing was lost.

    python tests/fault_loop.py [--out DIR] [--random_kills N] [--occurrences middle|all] [--engine hf|vllm]
                               [--passes lora,full,dcp] [--dcp_classes fit|all] [--sites REGEX]

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

Three passes (`--passes`; the hf engine runs all three): `lora` (the run above, LoRA), `full` (`--finetune full`,
one process: model.safetensors, config.json, generation_config.json ...) and `dcp` (`--finetune full --shard fsdp
--nproc 2`: every torchrun rank writes its DCP shard `__<rank>_0.distcp`, rank 0 the `.metadata` and config.json).
The full and dcp passes fault only the sites they add (a site of the same name in an earlier pass is that pass's);
a dcp site is a site of one rank (`SITE %R`), faulted in that rank alone. The ranks are separate processes started by
torchrun: the fault reaches them through the environment (tests/faults.py:site_env), which a sitecustomize.py made
for the loop (tests/faults.py:rank_hook) reads in every rank. A dcp case costs two torchrun launches (~20 s each on
2 cores), so by default (`--dcp_classes fit`) the shard files of each rank get all three classes and each other dcp
site one (rotating through ENOSPC, EIO, SIGKILL); `--dcp_classes all` gives every dcp site all three. A SIGKILLed rank
is reported by the launcher (`llmrl: rank R ended by SIGKILL`): that, with no traceback, is the dcp pass's "ended by
the signal". Their weights are compared whole (model.safetensors, or the DCP shards consolidated) within 1e-6.
Random kills and corrupt files are the lora pass's.

`--engine vllm` (in a venv with vLLM: `make faults-vllm`) runs the same loop with the in-process vLLM engine, at
the write sites that engine adds (its scratch adapters in the run directory; the sites it shares with hf are the
hf pass's), plus random kills; a SIGKILLed run's scratch adapters must be swept by the resume.

Each run is a fork of this process after the heavy imports (a warm start: the fault loop's cost is the runs, not
Python's start-up). It prints one line per fault class and engine and a total
`faults injected N, survived N, lost N`; a site that no fault reached is listed as uncovered. Exit 0 iff lost 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
os.environ.setdefault("LLMRL_CPU_DTYPE", "float32")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["HF_HUB_OFFLINE"] = "1"

import llmrl.cli  # noqa: E402  (imported before the forks: each run starts warm)
import llmrl.training.loop  # noqa: E402,F401
from faults import Injector, install, rank_hook, save_seen, site_env  # noqa: E402  (the injector)
from llmrl.checkpoint import latest_checkpoint, verify_checkpoint  # noqa: E402
from llmrl.training import hooks  # noqa: E402

STEPS = 2
NPROC = 2  # the dcp pass's ranks
MARKER = "LLMRL_FAULT_LOOP"  # set in every run's environment: a process that still has it afterwards was left behind
CLASSES = ("sigkill", "enospc", "eio")
ENGINE_SITE = re.compile(r"@rollout/")  # --engine vllm: the sites in the rollout engines' code (scratch adapters)
PASSES = ("lora", "full", "dcp")
LABEL = {"lora": None, "full": "full", "dcp": "dcp"}  # the tally's name of a pass (lora: the engine's, hf or vllm)


# --------------------------------------------------------------------------------------------- one run


@dataclass
class Outcome:
    status: str  # "ok", "signal N", "exit N"
    stderr: str
    seen: dict[str, int]
    example: dict[str, str]
    seconds: float
    fired: bool = False  # the fault fired (a SIGKILLed rank cannot say so otherwise)


HOOK: dict[str, Path] = {}  # "dir": the folder of the ranks' sitecustomize.py (tests/faults.py:rank_hook), made by main


def rank_site(site: str) -> tuple[str, int]:
    """`SITE %R` (a site of rank R in the dcp pass) → (SITE, R)."""
    name, _, rank = site.rpartition(" %")
    return name, int(rank)


def run(argv: list[str], run_dir: Path, tmp_dir: Path, log: Path, *, site: str | None = None, occurrence: int = 0,
        kind: str = "", kill_after: float | None = None, after_checkpoint: int | None = None,
        ranks: bool = False) -> Outcome:
    """`llmrl ARGV` in a forked child with the injector installed; returns how it ended and the sites it visited.
    ranks (ARGV has --nproc): the child launches torchrun and every rank installs the injector from its environment
    (sites `SITE %R`; a `site` fires in its rank R alone); the child itself, the launcher, writes nothing."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    seen_file = log.with_suffix(".sites.json")
    fired = log.with_suffix(".fired")
    for stale in (seen_file, fired, *(log.with_suffix(f".sites.rank{r}.json") for r in range(NPROC))):
        stale.unlink(missing_ok=True)
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
            inj = Injector(run_dir.resolve(), tmp_dir.resolve(), site, occurrence, kind, str(fired))
            if ranks:  # each rank's injector: its sitecustomize reads this
                name, rank = rank_site(site) if site else (None, None)
                os.environ.update(site_env(run_dir.resolve(), tmp_dir.resolve(), log.with_suffix(".sites"), name, rank,
                                           occurrence, kind, fired))
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    [str(HOOK["dir"]), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
            else:
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
            save_seen(inj, str(seen_file))
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
    if ranks:  # every rank's sites, by rank
        seen = {"seen": {}, "example": {}}
        for r in range(NPROC):
            f = log.with_suffix(f".sites.rank{r}.json")
            if f.exists():
                mine = json.loads(f.read_text())
                seen["seen"] |= {f"{k} %{r}": v for k, v in mine["seen"].items()}
                seen["example"] |= {f"{k} %{r}": v for k, v in mine["example"].items()}
    return Outcome(how, log.read_text(errors="replace"), seen["seen"], seen["example"], time.perf_counter() - t0,
                   fired.exists())


ENGINE = {"name": "hf"}  # --engine: set once in main(), before any run


def train_args(model: str, out: Path, mode: str = "lora") -> list[str]:
    """A short run on the tiny model that reaches every kind of write: a checkpoint each step (two kept), samples,
    an eval at step 2 and the end, the report. toy_task's reward varies, so the weights move every step.
    mode: lora, full (--finetune full) or dcp (--finetune full --shard fsdp --nproc 2)."""
    from helpers import tiny_args

    extra = {"full": {"finetune": "full"}, "dcp": {"finetune": "full", "shard": "fsdp"}}.get(mode, {})
    return tiny_args(model, out, "grpo", steps=STEPS, eval_interval=2, eval_n=2, save_interval=1, keep_checkpoints=2,
                     rollout_engine=ENGINE["name"], **extra) + LAUNCH[mode]


MISSED = "missed"  # a random kill that came after its run had ended: nothing was injected
RESUME = ["--task", "toy_task:CharTask"]  # naming the task's code again: a resume never imports it unasked
LAUNCH = {"lora": [], "full": [], "dcp": ["--nproc", str(NPROC)]}  # how a pass's runs (and resumes) are launched


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
    a `tmpXXXX` folder of C++ sources and objects per compile, which a SIGKILL mid-compile leaves), and torchrun's
    `torchelastic_*` log folder: torch's files, not llmrl's (llmrl's own scratch lives in the run directory)."""
    if p.name.startswith("torchinductor_"):
        return True
    if p.name.startswith("torchelastic_") and p.is_dir():  # torchrun's log folder (the dcp pass): every launch leaves
        return True  # one, ended well or not (torch's, not llmrl's; the launcher could sweep it)
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


def one_line_stop(o: Outcome, codes: tuple[str, ...], rank_killed: bool = False) -> str | None:
    """None when `o` ended by SIGKILL, or with one of `codes` and exactly one `llmrl:` line and no traceback.
    rank_killed (a rank of a torchrun launch was SIGKILLed): the launcher says so in one line, and no traceback."""
    if o.status == f"signal {signal.SIGKILL}":
        return None
    if rank_killed:
        if "Traceback" in o.stderr:
            return "a traceback: " + o.stderr.strip().splitlines()[-1][:200]
        # (anywhere in a line: the launcher cannot know that a rank's progress bar left its line open)
        if o.status == "ok" or not re.search(r"llmrl: rank \d+ ended by SIGKILL", o.stderr):
            return f"ended with {o.status}, without `llmrl: rank R ended by SIGKILL`"
        return None
    if o.status not in codes:
        return f"ended with {o.status}: {o.stderr.strip().splitlines()[-1:] if o.stderr.strip() else ''}"
    if "Traceback" in o.stderr:
        return "a traceback: " + o.stderr.strip().splitlines()[-1][:200]
    lines = [ln for ln in o.stderr.splitlines() if ln.startswith("llmrl: stopped") or ln.startswith("llmrl: error")]
    if len(lines) != 1:
        return f"{len(lines)} stop lines"
    return None


def same_weights(reference: Path, run_dir: Path) -> str | None:
    """Full weights: None when the final checkpoint's weights (model.safetensors, or the DCP shards consolidated) equal
    the uninterrupted run's within 1e-6, as in helpers.assert_same_run. In a forked child: DCP's reader stays out of
    this process (it forks every run)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            ckpt = f"checkpoints/step_{STEPS:06d}"
            try:
                a, b = whole_weights(reference / ckpt), whole_weights(run_dir / ckpt)
                shared = a.keys() & b.keys()
                if not shared or (a.keys() ^ b.keys()) - {"lm_head.weight"}:  # a tied lm_head: saved once or twice
                    problem = f"different tensors: {sorted(a.keys() ^ b.keys())[:3]}"
                else:
                    diff = max((a[k] - b[k]).abs().max().item() for k in shared)
                    problem = f"weights differ by {diff:.2e}" if diff > 1e-6 else ""
            except Exception as e:  # noqa: BLE001 - a missing or unreadable checkpoint: said as the difference
                problem = f"{type(e).__name__}: {str(e)[:200]}"
            os.write(write, problem.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        return "the weight comparison failed"
    return f"differs from the uninterrupted run: {said}" if said else None


def whole_weights(ckpt: Path) -> dict:
    """A checkpoint's full weights: its model*.safetensors, or its DCP shards consolidated (the model's part)."""
    from safetensors.torch import load_file

    if not (ckpt / ".metadata").is_file():
        out = {}
        for f in sorted(ckpt.glob("model*.safetensors")):
            out |= load_file(f)
        return out
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(ckpt, Path(scratch) / "whole.pt")
        return torch.load(Path(scratch) / "whole.pt", weights_only=True)["model"]


def same_records(reference: Path, run_dir: Path) -> None:
    """helpers.assert_same_run's check of metrics.jsonl (each step once, the same values but timings), without its
    adapter: full weights are same_weights'."""
    from helpers import read_jsonl

    ra, rb = read_jsonl(reference / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb], "steps logged differ"
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys(), (x["step"], sorted(x.keys() ^ y.keys()))
        for k in x:
            if k.startswith("time/") or x[k] is None:
                continue
            same = abs(x[k] - y[k]) <= 1e-6 if isinstance(x[k], (int, float)) else x[k] == y[k]
            assert same, (x["step"], k, x[k], y[k])


def same_run(reference: Path, run_dir: Path, mode: str = "lora") -> str | None:
    """None when the final adapter or weights (within 1e-6), the logged steps (each once) and their values match,
    and the newest checkpoint verifies."""
    from helpers import assert_same_run

    try:
        if mode == "lora":
            assert_same_run(reference, run_dir, STEPS)
        else:
            problem = same_weights(reference, run_dir)
            if problem:
                return problem
            same_records(reference, run_dir)
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


def fault_then_resume(work: Path, model: str, reference: Path, mode: str = "lora", **fault) -> str | None:
    """One case: a faulted run into work/run, then a resume; the first invariant it breaks, or None."""
    run_dir, tmp_dir = work / "run", work / "tmp"
    ranks = mode == "dcp"
    o = run(train_args(model, run_dir, mode), run_dir, tmp_dir, work / "fault.log", ranks=ranks, **fault)
    if o.status == "ok" and fault.get("kill_after") is not None:
        return MISSED  # the run was faster than the reference: the kill came after it ended
    if fault.get("site") and not o.fired:
        return f"the fault never fired: the run ended with {o.status} (log {work / 'fault.log'})"
    # 2: a set-up write failed (`output_dir ... is not writable`)
    problem = one_line_stop(o, ("exit 1", "exit 2"), rank_killed=ranks and fault.get("kind") == "sigkill")
    if problem:
        return f"faulted run {problem} (log {work / 'fault.log'})"
    left = leftovers(run_dir, tmp_dir, files=False)
    if left:
        return f"after the fault: {', '.join(left[:3])}"
    # a fault before the first checkpoint left nothing to resume: the user runs the same command again
    # (what the refusal of `--resume` says: with --overwrite)
    again = ["train", "--resume", str(run_dir), *RESUME, *LAUNCH[mode]] \
        if latest_checkpoint(run_dir, report=lambda _: None) else [*train_args(model, run_dir, mode), "--overwrite"]
    r = run(again, run_dir, tmp_dir, work / "resume.log", ranks=ranks)
    if r.status != "ok":
        return f"resume {r.status}: {r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else ''}"
    return same_run(reference, run_dir, mode) or (", ".join(leftovers(run_dir, tmp_dir)[:3]) or None)


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


def dcp_classes(own: list[str], every: bool) -> dict[str, tuple[str, ...]]:
    """The classes each new site of the dcp pass gets: all three for the shard files (each rank's) and, with `every`,
    for every site; else one each for the others, rotating (a dcp case is two torchrun launches)."""
    shards = [site for site in own if "distcp]" in site]
    rest = [site for site in own if site not in shards]
    rotation = ("enospc", "eio", "sigkill")
    return {**{site: CLASSES for site in shards},
            **{site: CLASSES if every else (rotation[i % 3],) for i, site in enumerate(rest)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="working directory (default: a temporary one, removed when nothing is lost)")
    ap.add_argument("--random_kills", type=int, default=6)
    ap.add_argument("--occurrences", choices=("middle", "all"), default="middle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="cases run side by side")
    ap.add_argument("--list", action="store_true", help="only list the write sites of the uninterrupted runs")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="rollout engine (vllm: only the write sites it adds, see above)")
    ap.add_argument("--passes", default=",".join(PASSES),
                    help="lora, full (--finetune full), dcp (--finetune full --shard fsdp --nproc 2); hf engine only "
                         "for full and dcp")
    ap.add_argument("--dcp_classes", choices=("fit", "all"), default="fit",
                    help="fit: all three classes at the shard files, one at each other dcp site; all: three everywhere")
    ap.add_argument("--sites", metavar="REGEX", help="fault only the sites REGEX finds (with --passes: a quick look)")
    args = ap.parse_args()
    ENGINE["name"] = engine = args.engine
    passes = [mode for mode in PASSES if mode in args.passes.split(",")]
    if engine != "hf" or not passes:
        passes = ["lora"]  # the vLLM engine's own sites are LoRA's (scratch adapters)
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
    HOOK["dir"] = rank_hook(out / "rank-hook")
    label = {mode: LABEL[mode] or engine for mode in passes}
    references, refs = {}, {}
    for mode in passes:  # each pass's uninterrupted run: its write sites, and the weights every case must end with
        where = out / ("reference" if mode == "lora" else f"reference-{mode}")
        shutil.rmtree(where, ignore_errors=True)
        references[mode] = where / "run"
        refs[mode] = ref = run(train_args(model, where / "run", mode), where / "run", where / "tmp",
                               out / f"{where.name}.log", ranks=mode == "dcp")
        if ref.status != "ok":
            print(f"the uninterrupted run [{label[mode]}] failed ({ref.status}); see {out / f'{where.name}.log'}")
            return 1
        print(f"uninterrupted run [{label[mode]}]: {STEPS} steps in {ref.seconds:.1f} s; {len(ref.seen)} write sites in "
              f"llmrl's code{f' (over {NPROC} ranks)' if mode == 'dcp' else ''}, {sum(ref.seen.values())} writes",
              flush=True)
    if args.list:
        for mode in passes:
            print(f"[{label[mode]}]")
            for site, count in sorted(refs[mode].seen.items()):
                print(f"  {site} ×{count} ({refs[mode].example[site]})")
        return 0

    cases = []  # (class, pass, name, the case as a function of its work folder)
    owns, news, earlier = {}, {}, set()  # each pass's own sites (and how many); the site names of the passes before
    for mode in passes:
        sites, reference = refs[mode].seen, references[mode]
        if mode == "lora":
            # vllm: the engine's own sites in the run directory; its code also calls into vLLM and torch, which write
            # their kernel compiles to TMPDIR (and tolerate a failed write there): those are listed, not faulted
            own = sorted(sites) if engine == "hf" else [site for site in sorted(sites) if ENGINE_SITE.search(site)
                                                         and not refs[mode].example[site].startswith("..")]
        else:  # full, dcp: the sites they add (a dcp site of rank 0 named as an earlier pass's is that pass's)
            own = [site for site in sorted(sites) if not (site.removesuffix(" %0") in earlier)]
        earlier |= {site.removesuffix(" %0") for site in sites}
        news[mode] = len(own)
        owns[mode] = own = [site for site in own if not args.sites or re.search(args.sites, site)]
        classes = dcp_classes(own, args.dcp_classes == "all") if mode == "dcp" else {site: CLASSES for site in own}
        mine = []
        for site in own:
            for occ in range(1, sites[site] + 1) if args.occurrences == "all" else [sites[site] // 2 + 1]:
                for cls in classes[site]:
                    mine.append((cls, mode, f"{site}#{occ}", lambda w, site=site, occ=occ, cls=cls, mode=mode,
                                 ref=reference: fault_then_resume(w, model, ref, mode, site=site, occurrence=occ,
                                                                  kind=cls)))
        cases = mine + cases  # the slowest pass first: the others fill in beside it
    reference, ref = (references["lora"], refs["lora"]) if "lora" in passes else (None, None)
    if ref is not None:
        rng = random.Random(args.seed)
        for at in sorted(rng.uniform(0.1, 0.9) * ref.seconds for _ in range(args.random_kills)):
            cases.append(("random-sigkill", "lora", f"at {at:.1f} s",
                          lambda w, at=at: fault_then_resume(w, model, reference, kill_after=at)))
    # a corrupt file where one is read back: the run killed right after step 1's checkpoint, then one file damaged
    # (the files a resume reads are the same whichever engine wrote them: the hf pass's)
    if engine == "hf" and ref is not None:
        base = out / "killed-after-step1"
        shutil.rmtree(base, ignore_errors=True)
        o = run(train_args(model, base / "run"), base / "run", base / "tmp", out / "killed-after-step1.log",
                after_checkpoint=1)
        newest = latest_checkpoint(base / "run", report=lambda msg: None)
        if o.status != f"signal {signal.SIGKILL}" or newest is None:
            cases.append(("corrupt", "lora", "setup", lambda w: f"the run to damage ended with {o.status}"))
        else:
            targets = [p for p in sorted(newest.iterdir()) if p.is_file()]
            targets += [p for p in (base / "run" / "checkpoints" / "latest", base / "run" / "config.yaml",
                                    base / "run" / "metrics.jsonl") if p.exists()]
            for target in targets:  # a checkpoint's files rot (a byte flipped); the others are cut short by a crash
                damage = "flip" if target.parent == newest else "cut"
                cases.append(("corrupt", "lora", f"{damage} {target.relative_to(base / 'run')}",
                              lambda w, t=target, d=damage: damage_then_resume(w, base, t, d, reference)))
    print(f"{len(cases)} cases, {args.jobs} at a time", flush=True)

    def one(i_case):
        i, (cls, mode, name, fn) = i_case
        work = out / f"case{i:03d}"
        shutil.rmtree(work, ignore_errors=True)
        started = time.perf_counter()
        problem = fn(work)
        if problem is None:
            shutil.rmtree(work, ignore_errors=True)
        return cls, mode, name, problem, time.perf_counter() - started

    from concurrent.futures import ThreadPoolExecutor

    tally = Tally()
    busy = defaultdict(float)  # seconds of cases per pass (summed over the jobs side by side)
    with ThreadPoolExecutor(args.jobs) as pool:
        for cls, mode, name, problem, seconds in pool.map(one, enumerate(cases)):
            tally.add(cls, label[mode], name, problem)
            busy[mode] += seconds

    for (cls, eng), (injected, survived) in sorted(tally.results.items()):
        print(f"{cls}[{eng}]: injected {injected}, survived {survived}, lost {injected - survived}")
    for mode in passes:
        sites, own, example = refs[mode].seen, owns[mode], refs[mode].example
        reached = {name.rsplit("#", 1)[0] for cls, m, name, _ in cases if m == mode and cls in CLASSES}
        uncovered = sorted(set(own) - reached)
        others = len(sites) - news[mode]
        print(f"write sites [{label[mode]}]: {len(sites)}" + (f" over {NPROC} ranks" if mode == "dcp" else "")
              + (f", the {engine} engine's own: {len(own)}" if mode == "lora" and engine != "hf" else "")
              + (f", new {news[mode]} (the {others} others: the earlier passes')" if mode != "lora" else "")
              + (f", chosen by --sites {len(own)}" if args.sites else "")
              + f", covered {len(own) - len(uncovered)}" + (f", uncovered: {', '.join(uncovered)}" if uncovered else "")
              + f"; cases {busy[mode]:.0f} s")
        for site, count in sorted(sites.items()):
            if mode != "lora" and site not in own:
                continue
            note = "" if site in own else " (torch's, in TMPDIR: not faulted)" if example[site].startswith("..") \
                else " (the hf pass's)"
            if mode == "dcp" and site in own:
                note = f" ({', '.join(dcp_classes(own, args.dcp_classes == 'all')[site])})"
            print(f"  {site} ×{count} ({example[site]}){note}")
    if tally.missed:
        print(f"random kills that came after their run had ended (not counted): {tally.missed}")
    not_run = [f"{mode} (--passes)" for mode in PASSES if mode not in passes and engine == "hf"]
    print({"hf": "engines not run here: vllm (make faults-vllm), vllm-server",
           "vllm": "engines not run here: hf (make faults), vllm-server"}[engine]
          + (f"; passes not run: {', '.join(not_run)}" if not_run else ""))
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
