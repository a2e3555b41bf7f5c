"""How many torch CPU threads a run uses: the cores it may run on, less those other processes keep busy.

OpenMP threads meet at a barrier after every parallel region. When another process holds one of the
cores, the thread that shares it runs in scheduler slices and every other thread waits at the barrier:
on 2 cores with two other CPU-bound processes, quickstart steps took 137–707 s with torch's default 2
threads and 17 s with `--num_threads 1` (7–10 s quiet). So, unless `--num_threads` is given, the run
reads how much CPU the other processes take on its cores — /proc/stat's busy jiffies of the cores in
this process's affinity, less this process's own CPU time — and uses the cores left (at least 1, at
most torch's default), at the start (`start_threads`) and again after every step (`StepThreads`).
Off Linux (no /proc/stat or affinity) the load is unknown and torch's default stays.

Kernel verdicts (models/packed_linear.py) read the same measure: one taken under load is provisional.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

# Other processes busier than this (in cores) make a reading "under load". Below it is the background of an
# idle desktop or server (daemons, an editor, this process's own helper threads), which best-of-many kernel
# timings filter out. A CPU-bound neighbour at ≥ 1/4 of a core holds a core for whole scheduler slices
# (~3-4 ms, longer than one timed call) again and again within a 20 ms timing window, so timings taken then
# are not the machine's. It sits well above the reading's resolution: over WINDOW_S at 100 jiffies/s a core
# counts 30 jiffies, so one jiffy of rounding at each end is ≤ 0.07 of a core.
LOADED_CORES = 0.25
WINDOW_S = 0.3  # the start-up reading: seconds this process sleeps while the others' use is counted
SLOW_FACTOR = 3.0  # a step this many times the median of the run's quiet steps, under load, is said once
# /proc/stat per-cpu fields: user nice system idle iowait irq softirq steal (guest, guest_nice: inside user)
BUSY_FIELDS, IDLE_FIELDS = (0, 1, 2, 5, 6, 7), (3, 4)


@dataclass(frozen=True)
class CpuReading:
    """One reading of the cores this process may run on."""

    busy: int  # jiffies (1/CLK_TCK s) those cores ran anything, summed over them: user+nice+system+irq+softirq+steal
    total: int  # busy + idle + iowait jiffies, summed over them
    cores: int  # how many cores were summed
    own_s: float  # CPU seconds this process has used so far, all its threads (user + system)


def parse_proc_stat(text: str, cpus: set[int]) -> tuple[int, int, int]:
    """(busy jiffies, total jiffies, cores found) summed over the `cpuN` lines of /proc/stat text whose N is in
    `cpus`. E.g. `cpu1 100 0 20 500 5 1 2 3 0 0` counts busy 100+0+20+1+2+3 = 126, total 126+500+5 = 631."""
    busy = total = cores = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()]
        b = sum(values[i] for i in BUSY_FIELDS if i < len(values))
        busy, total, cores = busy + b, total + b + sum(values[i] for i in IDLE_FIELDS), cores + 1
    return busy, total, cores


def others_cores(before: CpuReading, after: CpuReading, clk_tck: int) -> float | None:
    """Cores' worth of CPU that other processes used between two readings: (Δbusy − Δown·clk_tck) jiffies over
    the interval's length in jiffies (Δtotal / cores), at least 0; None when the interval is too short to count.
    E.g. 2 cores over 0.3 s at 100 jiffies/s: Δtotal 60, Δbusy 50, Δown 0.02 s (2 jiffies) → 48 / 30 = 1.6."""
    elapsed = (after.total - before.total) / max(after.cores, 1)  # jiffies per core
    if elapsed <= 0:
        return None
    others = (after.busy - before.busy) - (after.own_s - before.own_s) * clk_tck
    return max(0.0, others / elapsed)


def pick_threads(requested: int, default: int, usable: int, others: float | None) -> tuple[int, str]:
    """(torch threads, why, as a note for the run's kernels line). `requested` > 0 (--num_threads) is kept;
    else the `usable` cores less the others' busy cores rounded half up, at least 1, at most torch's
    `default`; with the load unknown (None), the default. E.g. 2 cores, others 1.6 → 2 − 2 → 1 thread."""
    if requested > 0:
        return requested, f"{_threads(requested)} (--num_threads {requested})"
    if others is None:
        return default, f"{_threads(default)} (torch's default; other processes' load unknown here: no /proc/stat)"
    n = max(1, min(default, usable - math.floor(others + 0.5)))
    if others < LOADED_CORES:
        return n, f"{_threads(n)} (quiet: other processes use {others:.1f} of {usable} cores)"
    return n, f"{_threads(n)} (other processes use {others:.1f} of {usable} cores; --num_threads N to choose)"


def slow_factor(seconds: float, quiet_s: list[float]) -> float | None:
    """How many times the median of the run's quiet steps (`quiet_s`, seconds) a step of `seconds` took; None
    before any quiet step. E.g. 30 s against [12, 9, 10] → 3.0."""
    return seconds / statistics.median(quiet_s) if quiet_s else None


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def read_cpu() -> CpuReading | None:
    """This moment's reading of the cores in this process's affinity; None off Linux (no /proc/stat or
    sched_getaffinity) or where none of those cores is listed."""
    try:
        cpus = os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as f:
            text = f.read()
    except (AttributeError, OSError):
        return None
    busy, total, cores = parse_proc_stat(text, cpus)
    return CpuReading(busy, total, cores, time.process_time() + descendants_cpu_s()) if cores else None


def descendants_cpu_s() -> float:
    """CPU seconds this process's own children have used (its grading and environment workers, a vLLM server):
    those reaped (os.times), and every live descendant's utime+stime plus its reaped children's (/proc/PID/stat
    fields 14-17), so that a run's own workers never count as "other processes". 0 off Linux."""
    t = os.times()
    total, parents, times = t.children_user + t.children_system, {}, {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        except OSError:
            continue  # it exited meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    todo, jiffies = list(children.get(os.getpid(), [])), 0
    while todo:
        pid = todo.pop()
        jiffies += times[pid]
        todo += children.get(pid, [])
    return total + jiffies / clk_tck()


def clk_tck() -> int:
    """Jiffies per second of /proc/stat (100 on most Linux systems)."""
    return os.sysconf("SC_CLK_TCK")


def measure_others(window_s: float = WINDOW_S) -> tuple[float, int] | None:
    """(cores' worth of CPU other processes use, cores read), over `window_s` seconds of this process
    sleeping; None where the load cannot be read."""
    before = read_cpu()
    if before is None:
        return None
    time.sleep(window_s)
    after = read_cpu()
    others = None if after is None else others_cores(before, after, clk_tck())
    return None if others is None else (others, after.cores)


@functools.cache
def torch_default_threads() -> int:
    """torch's own thread count, read before llmrl first changes it (the cap of the automatic choice)."""
    return torch.get_num_threads()


def start_threads(requested: int, on_cpu: bool) -> str:
    """Set torch's thread count at a run's start: `requested` (--num_threads) when > 0, else on CPU the choice
    of `pick_threads` from a WINDOW_S reading, else (a GPU run) torch's default. Returns the note saying why."""
    default = torch_default_threads()
    if requested <= 0 and not on_cpu:
        torch.set_num_threads(default)  # (an earlier CPU run in this process may have lowered it)
        return f"{_threads(default)} (torch's default)"
    reading = measure_others() if requested <= 0 else None
    others, usable = reading if reading is not None else (None, default)
    n, note = pick_threads(requested, default, usable, others)
    torch.set_num_threads(n)
    return note


@dataclass
class StepThreads:
    """Automatic threads during a run's steps: after each, the others' load over the interval since the last
    reading (no extra wait) sets the thread count again, lower or back up (`pick_threads`); the first change,
    and the first step under load over SLOW_FACTOR × the median of the run's quiet steps, are each said once."""

    default: int  # torch's default thread count: the most it sets
    last: CpuReading  # the reading at the end of the previous step (or the loop's start)
    quiet_s: list[float] = field(default_factory=list)  # seconds of the steps run with others < LOADED_CORES
    said_change: bool = False
    said_slow: bool = False

    @classmethod
    def begin(cls, requested: int, on_cpu: bool) -> StepThreads | None:
        """A tracker for an automatic-thread CPU run whose load can be read; None otherwise (--num_threads given,
        a GPU run, no /proc/stat): the thread count then never changes."""
        reading = read_cpu() if requested <= 0 and on_cpu else None
        return None if reading is None else cls(torch_default_threads(), reading)

    def after_step(self, step: int, seconds: float) -> list[str]:
        """Read the load over the step just run (`seconds` long), set the thread count for the next, and return
        the lines to print (at most one of each kind per run)."""
        now = read_cpu()
        if now is None:
            return []
        others = others_cores(self.last, now, clk_tck())
        self.last = now
        if others is None:
            return []
        lines = []
        threads = torch.get_num_threads()
        factor = slow_factor(seconds, self.quiet_s)
        if others < LOADED_CORES:
            self.quiet_s.append(seconds)
        elif factor is not None and factor > SLOW_FACTOR and not self.said_slow:
            self.said_slow = True
            lines.append(f"step {step} took {seconds:.0f} s, {factor:.1f}× this run's quiet steps: other processes used "
                         f"{others:.1f} of {now.cores} cores while it ran {_threads(threads)}; the thread count follows "
                         "their load, --num_threads N fixes it")
        n, note = pick_threads(0, self.default, now.cores, others)
        if n != threads:
            torch.set_num_threads(n)
            if not self.said_change:
                self.said_change = True
                lines.append(f"after step {step}: {note.replace(' (', ' from now (', 1)}")
        return lines
