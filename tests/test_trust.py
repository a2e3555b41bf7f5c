"""A run directory someone hands you runs no code: the task code its config names (`file.py:Name`,
`module:Name`) is imported by eval/export/chat/resume only with --trust_task_code or the task named again
with --task (tasks.check_task_code); built-in tasks need neither."""

from pathlib import Path

from types import SimpleNamespace

import pytest

from helpers import cli, run_cli, tiny_args

TASK_FILE = """from pathlib import Path

Path({marker!r}).write_text("imported")  # what a hostile task file could do instead

from toy_task import CharTask


class Marked(CharTask):
    pass
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    """(run directory trained 1 step on a task file that leaves a marker when imported, the task spec, the marker)."""
    root = tmp_path_factory.mktemp("trust")
    marker = root / "imported.txt"
    (root / "marked_task.py").write_text(TASK_FILE.format(marker=str(marker)))
    spec = f"{root / 'marked_task.py'}:Marked"
    out = root / "run"
    cli(*tiny_args(tiny_model_dir, out, "grpo", steps=1, task=spec, eval_n=1))  # --task on its own command line
    assert marker.exists()
    marker.unlink()
    return out, spec, marker


COMMANDS = {
    "eval --adapter": lambda run, out: ["eval", "--adapter", str(run / "checkpoints" / "step_000001"), "--eval_n", "1"],
    "eval --run": lambda run, out: ["eval", "--run", str(run), "--eval_n", "1"],
    "export --merge": lambda run, out: ["export", str(run), "--out", str(out), "--merge"],
    "train --resume": lambda run, out: ["train", "--resume", str(run)],
    "chat": lambda run, out: ["chat", str(run), "--max_new_tokens", "2"],
}


def refused(command: str, run_dir: Path, spec: str, marker: Path, out: Path) -> None:
    p = run_cli(*COMMANDS[command](run_dir, out))
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and spec in p.stderr and "--trust_task_code" in p.stderr and "--task" in p.stderr
    assert p.stderr.startswith(f"llmrl: error: run dir {run_dir} names task code"), p.stderr
    assert not marker.exists() and not out.exists()


def test_chat_refuses_a_run_dir_task_file_in_one_line_and_does_not_import_it(run, tmp_path):
    refused("chat", *run, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval --adapter", "eval --run", "export --merge", "train --resume"])
def test_a_run_dir_task_file_is_refused_and_runs_when_named_again_with_task(run, tmp_path, command):
    run_dir, spec, marker = run
    refused(command, run_dir, spec, marker, tmp_path / "out")
    try:
        cli(*COMMANDS[command](run_dir, tmp_path / "out"), "--task", spec)
        assert marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_resume_on_several_processes_is_refused_before_torchrun_starts(run):
    run_dir, spec, marker = run
    p = run_cli("train", "--resume", str(run_dir), "--nproc", "2")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and spec in p.stderr, p.stderr[-2000:]
    assert "launching" not in p.stderr and not marker.exists()


@pytest.mark.parametrize("command", ["eval --run", "train --resume"])
def test_trust_task_code_imports_it(run, tmp_path, command):
    run_dir, spec, marker = run
    try:
        cli(*COMMANDS[command](run_dir, tmp_path / "out"), "--trust_task_code")
        assert marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_built_in_tasks_and_trusted_code_pass_the_check():
    from llmrl.errors import UserError
    from llmrl.tasks import check_task_code

    def cfg(task, **kw):
        return SimpleNamespace(task=task, reward_funcs=kw.get("reward_funcs", []), environment_factory=kw.get("factory"))

    for task in ("format_copy", "math_hard", "guess", "calculator"):
        check_task_code(cfg(task), "R", trusted=False)
    check_task_code(cfg("x.py:Cls"), "R", trusted=True)
    with pytest.raises(UserError, match=r"run dir R names task code 'pkg.mod:Cls' \(a module it would import\)"):
        check_task_code(cfg("pkg.mod:Cls"), "R", trusted=False)
    with pytest.raises(UserError, match=r"run dir R names environment_factory 'env.py:Game' \(a file it would import\); "
                                        r".* --environment_factory"):
        check_task_code(cfg("dataset", factory="env.py:Game"), "R", trusted=False)


def test_a_run_dirs_library_task_naming_a_url_is_refused_like_code_and_never_contacted(run, tmp_path):
    """`task: openenv:URL` in a run directory would have eval contact that host, whose answers become the rewards:
    eval --run and chat refuse it in one line naming it (as task code), and nothing connects to the host."""
    import shutil
    import socket

    from llmrl.tasks import check_task_code, is_task_code

    run_dir, _, marker = run
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        spec = f"openenv:http://127.0.0.1:{listener.getsockname()[1]}"
        copy = tmp_path / "run"
        shutil.copytree(run_dir, copy)
        text = (copy / "config.yaml").read_text()
        (copy / "config.yaml").write_text("".join(f"task: {spec}\n" if line.startswith("task: ") else line
                                                  for line in text.splitlines(keepends=True)))
        for command in ("eval --run", "chat"):
            p = run_cli(*COMMANDS[command](copy, tmp_path / "out"))
            assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-2000:]
            assert p.stderr.startswith(f"llmrl: error: run dir {copy} names task '{spec}' (a server it would contact, "
                                       "which then chooses the rewards); pass --trust_task_code"), p.stderr
            assert "--task" in p.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    assert not marker.exists()
    assert is_task_code(spec) and is_task_code(f"format_copy,{spec}") and not is_task_code("reasoning_gym:chain_sum")
    cfg = SimpleNamespace(task=spec, reward_funcs=[], environment_factory=None)
    check_task_code(cfg, "R", trusted=True)
    with pytest.raises(Exception, match=rf"run dir R names task '{spec}' \(a server it would contact"):
        check_task_code(cfg, "R", trusted=False)
