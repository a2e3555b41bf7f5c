"""Every failure is one line, and loses nothing: a second trainer on a run directory, a config.yaml that no
longer matches the checkpoint it resumes, NumPy and torch numbers from a custom task, task state that a
checkpoint cannot hold. (Failed writes while saving and logging: tests/test_faults.py.)"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

import llmrl.training.loop as loop
from helpers import TESTS, cli, read_jsonl, run_cli, tiny_args
from llmrl.checkpoint import verify_checkpoint
from llmrl.config import check_resume_config, load_config
from llmrl.errors import ConfigError

STEPS = 3
HOLD_LOCK = ("import fcntl, os, sys, time\n"
             "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX)\n"
             "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
             "print('held', flush=True)\n"
             "time.sleep(600)\n")


def args(model, out, steps=STEPS, **extra):
    return tiny_args(model, out, "grpo", steps=steps, **{"eval_interval": 0, **extra})


def one_line(p: subprocess.CompletedProcess) -> str:
    """stderr, which must be exactly one line."""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return lines[0]


def files(run_dir) -> dict[str, bytes]:
    """Every file under a run directory (but the lock file, which its holder writes) and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A run of STEPS steps, every checkpoint kept."""
    out = tmp_path_factory.mktemp("safety") / "finished"
    cli(*args(tiny_model_dir, out, save_interval=1, keep_checkpoints=0))
    return out


def test_a_second_trainer_on_a_locked_run_stops_at_once_and_touches_nothing(finished, tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    saving = out / "checkpoints" / ".tmp-step_000004-x1y2z3"  # the holder's save in progress
    saving.mkdir()
    (saving / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    before = files(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = [run_cli(*args(tiny_model_dir, out), "--overwrite"),  # would delete the run and its save
                   run_cli("train", "--resume", str(out), "--trust_task_code")]  # would clear the save's .tmp-*
    finally:
        holder.kill()
        holder.wait()
    for p in refused:
        assert p.returncode == 2
        assert one_line(p) == (f"llmrl: error: output_dir {out} is in use by another llmrl trainer (pid {holder.pid}, "
                               f"{out / '.lock'}): wait for it to end or stop it, or use another --output_dir")
    assert files(out) == before


@pytest.mark.slow
def test_a_running_trainer_holds_its_run_until_it_ends(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([sys.executable, str(TESTS / "faults.py"), "slow_rollout",
                                  *args(tiny_model_dir, out, steps=50, save_interval=1)],
                                 stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONPATH": str(TESTS)})
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "latest").exists() and time.time() < deadline:
            time.sleep(0.05)
        p = run_cli(*args(tiny_model_dir, out), "--overwrite")
        assert p.returncode == 2 and f"is in use by another llmrl trainer (pid {first.pid}," in one_line(p)
        assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]  # untouched, still training
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert verify_checkpoint(out / "checkpoints" / (out / "checkpoints" / "latest").read_text()) is None
    p = cli("train", "--resume", str(out), "--steps", "1", "--trust_task_code")  # the dead holder's lock is gone
    assert "already ran its 1 steps" in p.stderr


@pytest.mark.parametrize("damage", ["cut_at_a_line", "cut_in_a_value", "emptied", "edited", "not_yaml"])
def test_a_config_yaml_unlike_its_checkpoint_is_refused_on_resume(finished, tmp_path, damage):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    path = out / "config.yaml"
    text = path.read_text()
    if damage == "cut_at_a_line":  # what a full disk made of it before: every key after the cut at its default
        path.write_text(text[: text.index("\nkeep_checkpoints:") + 1])
    elif damage == "cut_in_a_value":  # max_prompt_tokens: 64 -> max_prompt_tokens: 6
        path.write_text(text[: text.index("\nmax_prompt_tokens: ") + len("\nmax_prompt_tokens: 6")])
    elif damage == "emptied":
        path.write_text("")
    elif damage == "edited":
        path.write_text(text.replace("\nkeep_checkpoints: 0\n", "\nkeep_checkpoints: 1\n"))
    else:
        path.write_text(text.replace("\nlr: 0.01\n", "\nlr: [0.01\n"))
    before = files(out)
    p = run_cli("train", "--resume", str(out), "--trust_task_code")
    assert p.returncode == 2
    line = one_line(p)
    saved_in = f"{out / 'checkpoints' / 'step_000003' / 'trainer_state.json'} (key config)"
    if damage.startswith("cut"):
        assert line == (f"llmrl: error: config file '{path}': cut short (its last line is not '# end of config'); the "
                        "run's config is also in each checkpoint's trainer_state.json (key config)")
    elif damage == "not_yaml":
        assert line.startswith(f"llmrl: error: config file '{path}': not valid YAML (")
    elif damage == "edited":
        assert line == (f"llmrl: error: --resume {out}: {path} does not match the config saved in step_000003 "
                        "(differs: keep_checkpoints (0 in the checkpoint, 1 in the file)); "
                        f"restore it from {saved_in}, and give changes as options (--steps ...)")
    else:  # all defaults: the command line may stop first on one of them (the default model is not at hand)
        with pytest.raises(ConfigError) as refused:
            check_resume_config(out)
        assert str(refused.value).startswith(f"--resume {out}: {path} does not match the config saved in step_000003 "
                                             "(lacks model, task, ")  # ... 6 named, then "and N more"
        assert str(refused.value).endswith(f" more); restore it from {saved_in}, and give changes as options (--steps ...)")
    assert checkpoints(out) == ["step_000001", "step_000002", "step_000003"]
    assert files(out) == before


@pytest.mark.slow
def test_config_yaml_changes_with_the_checkpoint_that_uses_it(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = (out / "config.yaml").read_bytes()
    p = run_cli("train", "--resume", str(out), "--steps", "5", "--trust_task_code", fault="kill_in_rollout@1")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert (out / "config.yaml").read_bytes() == before  # killed before a checkpoint with steps 5: still step 3's
    cli("train", "--resume", str(out), "--steps", "4", "--trust_task_code")
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 4
    p = cli("train", "--resume", str(out), "--trust_task_code")
    assert "already ran its 4 steps" in p.stderr


def in_process(model, out, **overrides):
    argv = args(model, out, **overrides)[1:]
    return load_config(None, {argv[i].lstrip("-"): argv[i + 1] for i in range(0, len(argv), 2)})


def plain_json(value) -> bool:
    """True if `value` is made of what json.loads returns (no NumPy or torch type slipped through as text)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain_json(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@pytest.mark.slow
@pytest.mark.parametrize("task", ["reward", "NumpyTask"])
def test_numpy_and_torch_numbers_from_a_task_are_logged_as_plain_numbers(tmp_path, tiny_model_dir, task):
    out = tmp_path / "run"
    prompts = {"prompts": str(TESTS.parent / "examples" / "brevity_prompts.jsonl")} if task == "reward" else {}
    result = loop.train(in_process(tiny_model_dir, out, task=f"{TESTS / 'numpy_reward.py'}:{task}", steps=2,
                                   eval_interval=1, eval_n=2, **prompts))
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["reward/errors"] == 0 for r in train)
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 6 and all(type(s["reward"]) is float for s in samples)
    assert all(plain_json(r) for r in records + samples + read_jsonl(out / "eval_samples.jsonl"))
    assert plain_json(result.last_metrics)
    if task == "NumpyTask":
        assert all(type(s["answer"]) is int and type(s["components"]["long"]) is float for s in samples)
        assert all(r["reward/chars"] == sum(len(s["completion"]) for s in samples if s["step"] == r["step"]) for r in train)
        evals = [r for r in records if "eval/reward" in r]
        assert [(r["eval/distinct"], r["eval/count"], r["eval/flag"]) for r in evals] == [(0.5, 2, True)] * 3


def test_task_state_a_checkpoint_cannot_hold_is_refused_before_step_1(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = run_cli(*args(tiny_model_dir, out, task=f"{TESTS / 'numpy_reward.py'}:SetStateTask"))
    assert p.returncode == 2
    assert one_line(p) == (f"llmrl: error: task {TESTS / 'numpy_reward.py'}:SetStateTask: state_dict()['seen'] cannot be "
                           "saved as JSON (Object of type set is not JSON serializable); a checkpoint saves the task's "
                           "state as JSON: return numbers, strings, lists and dicts of them")
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"state_dict\(\)\['seen'\]"):
        loop.train(in_process(tiny_model_dir, out, task="numpy_reward:SetStateTask"))


def test_a_log_shorter_than_its_checkpoint_says_is_refused_in_one_line(tmp_path):
    """The logs are flushed before each checkpoint, which records their sizes: a resume that finds one shorter
    (cut or damaged) refuses rather than continue with records missing; longer (steps after the checkpoint,
    a half-written last line) is what a kill leaves, and is cut back by the resume."""
    from llmrl.errors import DataError
    from llmrl.logger import check_log_sizes

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "rew')
    (tmp_path / "samples.jsonl").write_text('{"step": 1}\n')
    check_log_sizes(tmp_path, {"metrics.jsonl": 33, "samples.jsonl": 12}, "step_000001")
    with pytest.raises(DataError, match=r"samples\.jsonl holds 12 bytes, fewer than the 13 it held when step_000001"):
        check_log_sizes(tmp_path, {"metrics.jsonl": 33, "samples.jsonl": 13}, "step_000001")
    with pytest.raises(DataError, match=r"eval_samples\.jsonl holds 0 bytes"):
        check_log_sizes(tmp_path, {"eval_samples.jsonl": 5}, "step_000001")


def test_scratch_adapters_live_in_the_run_and_a_dead_process_s_are_swept(tmp_path, tiny_model_dir):
    """An engine's scratch adapters go under the run directory; the next start sweeps those of a process that
    is gone, and keeps those of one that is alive (an `llmrl eval` of the same run)."""
    from llmrl.checkpoint import remove_stale_temporaries
    from llmrl.rollout.base import scratch_dir

    run = tmp_path / "run"
    run.mkdir()
    own = scratch_dir(run)
    assert own.parent == run and own.name.startswith(f".tmp-adapters-{os.getpid()}-")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = run / f".tmp-adapters-{int(dead.stdout)}-x1"
    (gone / "v1").mkdir(parents=True)
    (gone / "v1" / "adapter_model.safetensors").write_bytes(b"0" * 10)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = run / f".tmp-adapters-{alive.pid}-x2"
        other.mkdir()
        remove_stale_temporaries(run)
        assert not gone.exists() and other.exists() and own.exists()
    finally:
        alive.kill()
        alive.wait()
    remove_stale_temporaries(run)
    assert not other.exists()
    # a run directory that cannot be written: the system's temp dir
    assert scratch_dir(tmp_path / "missing").parent != tmp_path / "missing"


def test_a_full_disk_while_writing_a_scratch_adapter_is_a_one_line_engine_stop(tmp_path, tiny_model_dir):
    """ENOSPC (safetensors raises its own error type) while an engine writes the policy's adapter: EngineDied,
    which the loop turns into a checkpoint and one line; nothing half-written is left."""
    import errno

    from safetensors import SafetensorError

    from llmrl.errors import EngineDied
    from llmrl.rollout.base import write_adapter

    class Full:
        def save_pretrained(self, path):
            os.makedirs(path)
            open(os.path.join(path, "adapter_config.json"), "w").close()
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    class Broken:
        def save_pretrained(self, path):
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(EngineDied, match=r"could not write the scratch adapter .*v1: No space left on device"):
        write_adapter(Full(), tmp_path / "v1")
    assert not (tmp_path / "v1").exists()
    with pytest.raises(EngineDied, match="Input/output error"):
        write_adapter(Broken(), tmp_path / "v2")
