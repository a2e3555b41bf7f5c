"""What a first-time user meets: one-line errors that leave nothing behind, help and version, resume
messages, the Python API example, and the exported model outside llmrl."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import TESTS, cli, lora_tensors, plain_greedy, read_jsonl, run_cli, tiny_args

REPO = TESTS.parent


@pytest.mark.slow
def test_cuda_on_a_cpu_torch_and_math_hard_offline_are_one_line_and_leave_no_directory(tmp_path, tiny_model_dir):
    if torch.cuda.is_available():
        return  # the point is a machine without CUDA
    out = tmp_path / "cuda"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", device="cuda"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "device=cuda" in p.stderr, p.stderr[-1000:]
    assert not out.exists()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "math"
    p = subprocess.run([sys.executable, "-m", "llmrl", *tiny_args(tiny_model_dir, out, "grpo", task="math_hard")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr[-1000:]
    assert "--math_data" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()
    p = run_cli("eval", "--base", "--model", tiny_model_dir, "--task", "toy_task:CharTask", "--device", "cuda")
    assert p.returncode == 2 and "device=cuda" in p.stderr and "Traceback" not in p.stderr


def test_version_and_did_you_mean():
    from llmrl import __version__

    p = run_cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"llmrl {__version__}"
    p = run_cli("train", "--gruop_size", "4")
    assert p.returncode == 2 and "did you mean --group_size?" in p.stderr and "llmrl train --help" in p.stderr


@pytest.mark.slow
def test_resume_says_where_it_starts_and_a_finished_run_does_nothing(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    p = cli(*tiny_args(tiny_model_dir, out, "grpo", steps=1, eval_n=0))
    assert f"llmrl: adapter: {out / 'checkpoints' / 'step_000001'}" in p.stderr
    p = cli("train", "--resume", str(out), "--steps", "2", "--trust_task_code")
    assert f"resuming {out} from step_000001 (step 1 of 2)" in p.stderr
    p = cli("train", "--resume", str(out), "--steps", "2", "--trust_task_code")
    assert "already ran its 2 steps; nothing to do" in p.stderr and p.stdout.strip() == ""
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == 2


def test_api_example_runs(tmp_path, tiny_model_dir):
    p = subprocess.run([sys.executable, str(REPO / "examples" / "api_example.py"), tiny_model_dir], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600,
                       env=os.environ)
    assert p.returncode == 0, p.stderr[-2000:]
    adapter, reward = p.stdout.split()[-2:]
    assert adapter.endswith("step_000002") and 0.0 <= float(reward) <= 1.0
    records = read_jsonl(tmp_path / "runs" / "api-example" / "metrics.jsonl")
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]


@pytest.mark.slow
def test_export_merge_loads_with_plain_transformers_and_gives_llmrl_eval_completions(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, run, "grpo", steps=2, eval_n=4, lr=0.05, lora_dropout=0))
    cli("eval", "--run", str(run), "--output", str(tmp_path / "eval.jsonl"), "--trust_task_code")
    expected = [r["completion"] for r in read_jsonl(tmp_path / "eval.jsonl")]
    cli("export", str(run), "--out", str(tmp_path / "merged"), "--merge", "--trust_task_code")
    cli("export", str(run), "--out", str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model_dir
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "grpo on toy_task:CharTask" in card and "steps | 2 of 2" in card and "eval/distinct" in card
    checkpoint = run / "checkpoints" / "step_000002"
    assert "steps | 2 of 2" in (checkpoint / "README.md").read_text()  # not PEFT's empty template
    assert json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model_dir

    assert plain_greedy(tmp_path / "merged") == expected
    assert any(expected)  # something was generated
    p = run_cli("export", str(run), "--out", str(tmp_path / "merged"))
    assert p.returncode == 2 and "not empty" in p.stderr


@pytest.mark.slow
def test_export_merges_in_fp32_when_the_run_trained_in_bf16(tmp_path, tiny_model_dir):
    """A run with bf16 weights: the merged export is W + s·B·A computed in fp32 from the fp32 base (a merge
    into bf16 weights rounds each element to 8 bits of mantissa and loses deltas below that), saved in the
    requested dtype, and the export prints its greedy check."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, run, "grpo", steps=1, eval_n=2, lr=3e-3, lora_dropout=0, dtype="bfloat16"))
    p = cli("export", str(run), "--out", str(tmp_path / "merged"), "--merge", "--trust_task_code")
    assert "greedy check: 4/4 eval prompts" in p.stderr  # check=4 prompts by default
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    adapter = lora_tensors(run / "checkpoints" / "step_000001")
    key = next(k for k in merged if k.endswith("layers.0.self_attn.q_proj.weight"))
    a = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    b = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    delta = (8 / 4) * b.float() @ a.float()  # lora_alpha / r
    assert merged[key].dtype == torch.float32 and delta.abs().max() > 0
    # fp32: W + ΔW rounded once (|error| ≤ u·|W + ΔW|, u = 2^-24); a bf16 merge errs by up to 2^-9·|W|
    expected = base[key].float() + delta
    assert (merged[key] - expected).abs().max() <= 2.0**-23 * expected.abs().max()
    p = cli("export", str(run), "--out", str(tmp_path / "bf16"), "--merge", "--dtype", "bfloat16", "--trust_task_code")
    assert load_file(tmp_path / "bf16" / "model.safetensors")[key].dtype == torch.bfloat16


def test_chat_replies_with_the_policy(tmp_path, tiny_model_dir):
    from llmrl.export import chat

    run = tmp_path / "run"
    cli(*tiny_args(tiny_model_dir, run, "grpo", steps=1, eval_n=0))
    lines: list[str] = []
    assert chat(run, lines=["Say something about 3.", "", "Again."], max_new_tokens=5, write=lines.append,
                trust_task_code=True) == 0
    assert lines[0].startswith("llmrl chat:") and len(lines) == 3


def test_readme_shows_the_tested_api_example_and_the_brevity_command():
    readme = (REPO / "README.md").read_text()
    code = (REPO / "examples" / "api_example.py").read_text().split('"""', 2)[2].strip()
    assert code in readme  # the README's example is the file the test above runs
    doc = (REPO / "examples" / "brevity_reward.py").read_text()
    assert "llmrl train --config configs/brevity.yaml" in doc and "llmrl train --config configs/brevity.yaml" in readme


@pytest.mark.slow
def test_a_run_raises_no_future_warning_from_transformers_or_peft(tmp_path, tiny_model_dir):
    """Both checkpointing settings, with every FutureWarning turned into an error."""
    for checkpointing in ("true", "false"):
        out = tmp_path / checkpointing
        args = tiny_args(tiny_model_dir, out, "grpo", steps=1, eval_n=2, gradient_checkpointing=checkpointing)
        p = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-m", "llmrl", *args], capture_output=True,
                           text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(TESTS)})
        assert p.returncode == 0 and "FutureWarning" not in p.stderr, p.stderr[-2000:]
    from llmrl.models.loading import add_lora

    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, 0.0, ["q_proj"], True)
    base = model.get_base_model()  # still on, under the new name where transformers has it (5.2x), else the old
    assert base.is_activation_checkpointing if hasattr(type(base), "is_activation_checkpointing") else base.is_gradient_checkpointing


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """The single `llmrl: error: ...` line of a failed run (exit 2, no traceback, nothing else on stderr)."""
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    return p.stderr.strip()


def test_group_size_1_is_refused_as_every_advantage_would_be_0():
    from llmrl.config import load_config
    from llmrl.errors import ConfigError

    for estimator in ("group_zscore", "group_mean", "rloo", "batch_zscore"):
        with pytest.raises(ConfigError, match=r"group_size=1: every advantage estimator .* is group-relative .* every "
                                              r"advantage 0 .* use group_size 2 or more"):
            load_config(None, {"group_size": "1", "batch_size": "8", "minibatch_size": "8", "adv_estimator": estimator})
    assert load_config(None, {"group_size": "2", "batch_size": "4", "minibatch_size": "8"}).group_size == 2


def test_a_model_path_that_does_not_exist_is_no_such_directory(tmp_path):
    from llmrl.config import load_config
    from llmrl.errors import ConfigError, ModelError
    from llmrl.models.loading import resolve_model_path

    for name in (str(tmp_path / "nope"), "./nope", "~/no-such-llmrl-model", "runs/a/b"):
        with pytest.raises(ConfigError) as e:
            load_config(None, {"model": name})
        assert str(e.value) == f"model={name!r}: no such directory"
        with pytest.raises(ModelError) as e:
            resolve_model_path(name)
        assert str(e.value) == f"model '{name}': no such directory"
    p = run_cli("train", "--model", "/nonexistent/dir")
    assert one_error_line(p) == "llmrl: error: model='/nonexistent/dir': no such directory"


def test_a_missing_task_file_is_no_such_file_not_an_unknown_task(tmp_path):
    from llmrl.config import load_config
    from llmrl.errors import ConfigError

    missing = tmp_path / "rewards.py"
    for task in (f"{missing}:reward", str(missing)):
        with pytest.raises(ConfigError) as e:
            load_config(None, {"task": task})
        assert str(e.value) == f"task={task!r}: no such file: {missing}"
    missing.write_text("def reward(prompt, completion):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="name the class or function in it too"):
        load_config(None, {"task": str(missing)})
    assert load_config(None, {"task": f"{missing}:reward"}).task == f"{missing}:reward"


def test_trl_option_names_point_to_llmrl_ones_on_the_command_line_and_in_yaml(tmp_path):
    p = run_cli("train", "--learning_rate", "1e-5", "--num_generations", "4", "--beta=0.1", "--max_completion_length", "64",
                "--gradient_accumulation_steps", "2")
    line = one_error_line(p)
    for trl, ours in [("learning_rate", "lr"), ("num_generations", "group_size"), ("beta", "kl_coef"),
                      ("max_completion_length", "max_new_tokens"), ("gradient_accumulation_steps", "grad_accum_steps")]:
        assert f"--{trl}: TRL's name for --{ours}" in line
    from llmrl.config import FIELDS, TRL_NAMES, load_config
    from llmrl.errors import ConfigError

    assert all(name in FIELDS and trl not in FIELDS for trl, (name, _) in TRL_NAMES.items())
    f = tmp_path / "trl.yaml"
    f.write_text("learning_rate: 1.0e-5\nper_device_train_batch_size: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "'learning_rate' (TRL's name for lr)" in str(e.value)
    assert "'per_device_train_batch_size' (TRL's name for minibatch_size (completions per minibatch" in str(e.value)


def test_every_unknown_yaml_key_is_named_at_once_with_its_suggestion(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("stepz: 3\nnum_generations: 4\nseed: 1\nzzz_nothing_alike: 1\nkl_coeff: 0.1\n")
    p = run_cli("train", "--config", str(f))
    assert one_error_line(p) == (
        f"llmrl: error: config file '{f}': unknown config keys 'stepz' (did you mean steps?), 'num_generations' "
        "(TRL's name for group_size), 'zzz_nothing_alike', 'kl_coeff' (did you mean kl_coef?)")


def test_ctrl_c_before_step_1_is_one_line_and_exit_130(tmp_path, tiny_model_dir):
    """SIGINT while the run starts: half a second in (importing torch and transformers), and as the run
    directory appears (loading the model). One line, no traceback, exit 130. The child gets SIGINT's default
    disposition, as from a terminal: where the suite was started in the background (`cmd &` in a script) it
    inherits an ignored SIGINT, which llmrl leaves ignored until its steps run (as nohup asks)."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for when in ("imports", "model"):
        out = tmp_path / when
        p = subprocess.Popen([sys.executable, "-m", "llmrl", *tiny_args(tiny_model_dir, out, "grpo", steps=50)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        if when == "imports":
            time.sleep(0.5)
        deadline = time.monotonic() + 300
        while when == "model" and not out.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        _, stderr = p.communicate(timeout=120)
        assert p.returncode == 130 and "Traceback" not in stderr, (when, stderr[-3000:])
        # one stop line, last; before it at most the start-up's own notes (a loaded machine may get that far)
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        assert lines[-1] == "llmrl: interrupted" and lines.count("llmrl: interrupted") == 1, (when, stderr[-3000:])
        assert all(line.startswith("llmrl: ") and not line.startswith(("llmrl: error", "llmrl: stopped"))
                   for line in lines[:-1]), (when, stderr[-3000:])


def refused_port() -> int:
    """A local port nothing listens on (connections to it are refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hub_id_without_a_reachable_hub_fails_in_seconds_and_a_cached_one_loads(tmp_path, tiny_model_dir):
    """Hub unreachable (HF_ENDPOINT on a refused port): an uncached hub id is one line at once, not a minute of
    huggingface_hub retries; a model in the local HF cache trains from it."""
    import shutil
    import time

    cache = tmp_path / "hub"
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_ENDPOINT": f"http://127.0.0.1:{refused_port()}", "HF_HUB_CACHE": str(cache)}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    out = tmp_path / "missing"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "llmrl", *tiny_args("someorg/somemodel", out, "grpo", steps=1)],
                       capture_output=True, text=True, timeout=300, env=env)
    seconds = time.monotonic() - t0
    line = one_error_line(p)
    assert line.startswith("llmrl: error: model 'someorg/somemodel': the Hugging Face hub (http://127.0.0.1:") and \
        "cannot be reached" in line and "not in the local cache" in line
    assert seconds < 40 and not out.exists()  # huggingface_hub's retries alone took 46 s (2 x 1+2+4+8+8)
    p = subprocess.run([sys.executable, "-m", "llmrl", *tiny_args("someorg/somemodel", out, "grpo", steps=1)],
                       capture_output=True, text=True, timeout=300, env={**env, "HF_HUB_OFFLINE": "1"})
    assert "HF_HUB_OFFLINE is set" in one_error_line(p)

    snapshot = cache / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--someorg--tiny" / "refs").mkdir()
    (cache / "models--someorg--tiny" / "refs" / "main").write_text("0" * 40)
    out = tmp_path / "cached"
    p = subprocess.run([sys.executable, "-m", "llmrl", *tiny_args("someorg/tiny", out, "grpo", steps=1, eval_n=0)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"model 'someorg/tiny' loads from the local cache, {snapshot}" in p.stderr and "Retrying" not in p.stderr
    assert (out / "checkpoints" / "step_000001").is_dir()


def test_a_missing_vllm_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    import importlib.util

    from llmrl import train
    from llmrl.config import load_config
    from llmrl.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    for engine in ("vllm", "vllm-server"):
        out = tmp_path / engine
        cfg = load_config(None, {"rollout_engine": engine, "model": str(tmp_path), "output_dir": str(out)})  # never loaded
        with pytest.raises(ConfigError) as e:
            train(cfg)
        assert str(e.value).startswith(f"rollout_engine={engine}: the vllm package is not installed") and "`make vllm`" in str(e.value)
        assert not out.exists()
    if find_spec("vllm") is None:
        p = run_cli("train", "--rollout_engine", "vllm", "--output_dir", str(tmp_path / "cli"))
        assert "the vllm package is not installed" in one_error_line(p) and not (tmp_path / "cli").exists()


def test_a_ctrl_c_swallowed_during_set_up_stops_before_step_1():
    """A library can swallow the CLI's Interrupted mid-import (the set-up then goes on): the loop's signal handler
    sees that the CLI's handler was called and stops before any step, with the handlers restored."""
    import signal

    from llmrl.cli import CtrlC
    from llmrl.training.run import StopOnSignal

    ctrl_c = CtrlC()
    before = signal.signal(signal.SIGINT, ctrl_c)
    try:
        with StopOnSignal():  # not called yet: the loop runs
            assert signal.getsignal(signal.SIGINT) is not ctrl_c
        ctrl_c.seen = True
        with pytest.raises(KeyboardInterrupt):
            with StopOnSignal():
                raise AssertionError("a step ran after a Ctrl-C")
        assert signal.getsignal(signal.SIGINT) is ctrl_c
    finally:
        signal.signal(signal.SIGINT, before)
