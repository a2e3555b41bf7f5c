"""`llmrl train --nproc N` runs torchrun through llmrl.launch: a rank's failure ends the launch with that rank's exit
code and its own one line (no ChildFailedError traceback from torchrun), a rank ended by a signal is named in one line,
and a multi-process run's resume command starts as many processes again."""

import os
import subprocess
import sys

import pytest

RANK_SCRIPT = """import os, signal, sys
rank = os.environ["RANK"]
if {kill_rank!r} == rank:
    os.kill(os.getpid(), signal.SIGKILL)
if {fail_rank!r} in (rank, "all"):
    print(f"llmrl: stopped: rank {{rank}} could not write", file=sys.stderr)
    sys.exit(1)
"""


def launch(tmp_path, kill_rank="", fail_rank=""):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(kill_rank=kill_rank, fail_rank=fail_rank))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "llmrl.launch", "--standalone", "--nproc_per_node=2", str(script)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_rank_that_stops_ends_the_launch_with_its_code_and_its_line_only(tmp_path):
    p = launch(tmp_path, fail_rank="1")
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr, p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("llmrl:")] == [
        "llmrl: stopped: rank 1 could not write"], p.stderr


def test_a_rank_killed_by_a_signal_is_named_in_one_line(tmp_path):
    p = launch(tmp_path, kill_rank="1")
    assert p.returncode == 128 + 9, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("llmrl:")] == [
        "llmrl: rank 1 ended by SIGKILL (out of memory?)"], p.stderr


def test_all_ranks_succeeding_is_exit_0(tmp_path):
    p = launch(tmp_path)
    assert p.returncode == 0 and "llmrl:" not in p.stderr, p.stderr


@pytest.mark.parametrize("env, flags", [
    ({}, ""),
    ({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}, " --nproc 3"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, " --nproc 2 --nnodes 2 --rdzv_endpoint HOST:PORT"),
])
def test_the_resume_command_starts_as_many_processes(monkeypatch, env, flags):
    from types import SimpleNamespace

    from llmrl.tasks import resume_command

    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = SimpleNamespace(task="format_copy", reward_funcs=[], environment_factory=None)
    assert resume_command(cfg, "runs/x") == f"llmrl train --resume runs/x{flags}"


def test_only_rank_0_prints_a_stop_of_every_rank(monkeypatch, capsys):
    from llmrl import cli
    from llmrl.errors import RunStopped

    def stop(args):
        raise RunStopped("could not write the checkpoint of step 2: rank 1: No space left on device", every_rank=True)

    monkeypatch.setattr(cli, "cmd_report", stop)
    for rank, printed in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["report", "x"]) == 1
        assert capsys.readouterr().err.count("llmrl: stopped:") == printed
