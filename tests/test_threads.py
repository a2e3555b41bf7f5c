"""Threads under contention (llmrl/threads.py) and kernel verdicts taken under load (models/packed_linear.py).
Every reading here is made by hand or monkeypatched: the tests hold on a busy machine."""

import json
import os

import pytest
import torch

from llmrl import threads
from llmrl.models import packed_linear
from llmrl.threads import CpuReading, StepThreads, others_cores, parse_proc_stat, pick_threads, slow_factor

STAT = """cpu  900 0 90 2000 10 0 0 0 0 0
cpu0 300 0 30 500 5 1 2 3 0 0
cpu1 100 0 20 500 5 1 2 3 7 0
cpu2 500 0 40 1000 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


@pytest.fixture
def kept_threads():
    """The test process's torch thread count, restored after a test that sets it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_proc_stat_sums_the_busy_and_total_jiffies_of_this_process_cores():
    # cpu1: busy user 100 + system 20 + irq 1 + softirq 2 + steal 3 = 126 (guest 7 is inside user), total 126 + idle
    # 500 + iowait 5 = 631; cpu2: busy 540, total 1540; the aggregate `cpu` line and cpu0 are not counted
    assert parse_proc_stat(STAT, {1, 2}) == (126 + 540, 631 + 1540, 2)
    assert parse_proc_stat(STAT, {7}) == (0, 0, 0)


def test_others_cores_is_the_busy_time_less_this_process_own_per_elapsed_core_time():
    before = CpuReading(busy=1000, total=5000, cores=2, own_s=10.0)
    # 2 cores over 0.3 s at 100 jiffies/s: 60 jiffies in all, 50 busy, 2 of them (0.02 s) this process's own
    after = CpuReading(busy=1050, total=5060, cores=2, own_s=10.02)
    assert others_cores(before, after, 100) == pytest.approx(48 / 30)  # 1.6 cores
    busy_self = CpuReading(busy=1040, total=5060, cores=2, own_s=10.45)  # own 45 jiffies > busy 40 (rounding): 0
    assert others_cores(before, busy_self, 100) == 0.0
    assert others_cores(before, before, 100) is None  # no time passed: nothing to count


@pytest.mark.parametrize("others, want", [(0.0, 2), (0.2, 2), (0.49, 2), (0.5, 1), (1.6, 1), (3.0, 1)])
def test_the_cores_left_by_others_rounded_half_up_and_at_least_one(others, want):
    n, note = pick_threads(0, default=2, usable=2, others=others)
    assert n == want
    assert ("quiet" in note) is (others < threads.LOADED_CORES)
    assert ("--num_threads N to choose" in note) is (others >= threads.LOADED_CORES)


def test_the_thread_choice_is_capped_at_torch_default_and_keeps_an_explicit_count():
    assert pick_threads(0, default=4, usable=8, others=1.0) == (4, "4 threads (other processes use 1.0 of 8 cores; "
                                                                   "--num_threads N to choose)")
    assert pick_threads(0, default=8, usable=8, others=2.7) == (5, "5 threads (other processes use 2.7 of 8 cores; "
                                                                   "--num_threads N to choose)")
    assert pick_threads(3, default=2, usable=2, others=1.9) == (3, "3 threads (--num_threads 3)")
    assert pick_threads(0, default=2, usable=2, others=None)[0] == 2  # the load unknown: torch's default
    assert pick_threads(0, default=2, usable=2, others=1.6)[1] == ("1 thread (other processes use 1.6 of 2 cores; "
                                                                   "--num_threads N to choose)")


def test_slow_factor_is_against_the_median_of_quiet_steps():
    assert slow_factor(30.0, [12.0, 9.0, 10.0]) == 3.0
    assert slow_factor(30.0, []) is None


def test_start_threads_keeps_an_explicit_count_under_load_and_lowers_an_automatic_one(monkeypatch, kept_threads):
    monkeypatch.setattr(threads, "torch_default_threads", lambda: 2)
    monkeypatch.setattr(threads, "measure_others", lambda: (1.6, 2))
    assert threads.start_threads(3, on_cpu=True) == "3 threads (--num_threads 3)" and torch.get_num_threads() == 3
    assert threads.start_threads(0, on_cpu=True).startswith("1 thread (other processes use 1.6 of 2 cores")
    assert torch.get_num_threads() == 1
    assert threads.start_threads(0, on_cpu=False) == "2 threads (torch's default)" and torch.get_num_threads() == 2
    torch.set_num_threads(1)
    monkeypatch.setattr(threads, "measure_others", lambda: (0.1, 2))
    assert threads.start_threads(0, on_cpu=True) == "2 threads (quiet: other processes use 0.1 of 2 cores)"
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(threads, "measure_others", lambda: None)  # off Linux
    assert "load unknown" in threads.start_threads(0, on_cpu=True) and torch.get_num_threads() == 2
    assert StepThreads.begin(3, on_cpu=True) is None  # --num_threads: never changed between steps
    assert StepThreads.begin(0, on_cpu=False) is None  # a GPU run: torch's default stays


def test_between_steps_the_count_follows_the_load_and_a_slow_loaded_step_is_said_once(monkeypatch, kept_threads):
    # each step: 10 s on 2 cores at 100 jiffies/s = 2000 jiffies in all; this process uses `own` seconds of CPU
    # and the others `others` cores, so the busy jiffies are own·100 + others·1000
    clock = {"busy": 0, "total": 0, "own": 0.0}

    def step(own: float, others: float):
        clock["busy"] += round(own * 100 + others * 1000)
        clock["total"] += 2000
        clock["own"] += own

    monkeypatch.setattr(threads, "read_cpu", lambda: CpuReading(clock["busy"], clock["total"], 2, clock["own"]))
    monkeypatch.setattr(threads, "clk_tck", lambda: 100)
    torch.set_num_threads(2)
    tracker = StepThreads.begin(0, on_cpu=True)
    tracker.default = 2
    step(own=19.0, others=0.05)  # quiet
    assert tracker.after_step(1, 9.0) == [] and torch.get_num_threads() == 2
    step(own=19.0, others=0.0)
    assert tracker.after_step(2, 11.0) == [] and tracker.quiet_s == [9.0, 11.0]
    step(own=10.0, others=1.6)  # two busy neighbours: one thread from now, said once
    lines = tracker.after_step(3, 12.0)
    assert torch.get_num_threads() == 1
    assert lines == ["after step 3: 1 thread from now (other processes use 1.6 of 2 cores; --num_threads N to choose)"]
    step(own=6.0, others=1.4)
    lines = tracker.after_step(4, 35.0)  # 3.5 × the quiet median (10 s), under load: said once
    assert lines == ["step 4 took 35 s, 3.5× this run's quiet steps: other processes used 1.4 of 2 cores while it ran "
                     "1 thread; the thread count follows their load, --num_threads N fixes it"]
    step(own=6.0, others=1.4)
    assert tracker.after_step(5, 40.0) == [] and torch.get_num_threads() == 1
    step(own=19.0, others=0.0)  # the neighbours ended: back to two threads (the change was said already)
    assert tracker.after_step(6, 10.0) == [] and torch.get_num_threads() == 2


def test_a_verdict_measured_under_load_is_provisional_and_a_quiet_one_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path))
    measured = []

    def measure():
        measured.append(1)
        return len(measured) % 2 == 1, {"fp32": 100.0, "bf16": 50.0 * len(measured)}

    def verdict(others: float) -> dict:
        monkeypatch.setattr(threads, "measure_others", lambda: (others, 2))
        return packed_linear._cached_verdict("test shape", measure)

    def stored() -> dict:
        return next(iter(json.loads((tmp_path / "kernels.json").read_text()).values()))

    first = verdict(1.6)  # under load: used by this run, kept only as provisional
    assert measured == [1] and first["provisional"] and first["others"] == 1.6
    assert stored() == first and "measured under load" in packed_linear._verdict_note(first)
    assert verdict(1.2) == first and measured == [1]  # still under load: the same provisional verdict, not measured
    quiet = verdict(0.1)  # the next quiet run measures again and keeps its verdict for good
    assert measured == [1, 1] and quiet == {"pays": False, "gflops": {"fp32": 100.0, "bf16": 100.0}} == stored()
    assert verdict(1.9) == quiet and verdict(0.0) == quiet and measured == [1, 1]
    assert packed_linear._verdict_note(quiet) == ""


def test_a_verdict_stored_before_is_read_without_measuring(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path))
    key = (f"{packed_linear._cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|"
           "bf16 vs fp32 1536x576")
    (tmp_path / "kernels.json").write_text(json.dumps({key: {"pays": True, "gflops": {"fp32": 300.0, "bf16": 900.0}}}))
    monkeypatch.setattr(threads, "measure_others", lambda: pytest.fail("a stored verdict needs no reading"))
    monkeypatch.setattr(packed_linear, "bf16_pays", lambda: pytest.fail("a stored verdict is not measured again"))
    monkeypatch.setattr(packed_linear, "cpu_bf16_flags", lambda: ["amx_bf16"])
    monkeypatch.delenv(packed_linear.CPU_DTYPE_ENV, raising=False)
    bf16, line = packed_linear.cpu_auto_precision()
    assert bf16 and "bf16 900" in line and "under load" not in line


def test_the_runs_own_workers_are_not_other_processes():
    """A child that has used 0.3 s of CPU counts as this process's own, alive (/proc/PID/stat) and after it is
    reaped (os.times): a run's grading and environment workers never lower its thread count. CPU time, not wall
    time: it holds on a loaded machine."""
    import subprocess
    import sys

    from llmrl.threads import descendants_cpu_s

    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    before = descendants_cpu_s()
    spin = "import time, sys\nwhile time.process_time() < 0.3: pass\nprint('spun', flush=True)\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        assert descendants_cpu_s() - before >= 0.29  # alive: its own stat line (one jiffy of rounding)
    finally:
        child.kill()
        child.wait()
    assert descendants_cpu_s() - before >= 0.29  # reaped: the kernel adds it to this process's children times
