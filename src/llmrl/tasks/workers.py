"""Where environment steps run, and how a step that never returns is stopped (config: env_isolation).

    steps = env_steps("process", env, workers=4)     # one per run (its EpisodeRunner), reused every turn
    results = steps.run([(episode, reply), ...], timeout)   # per job: the checked Turn, or why it failed

The steps of one turn's live episodes run at once, on up to `workers` workers. A step that raises, returns
something that is not a Turn, or overruns `timeout` seconds fails its job (a text; the episode ends with
`env_error`, reward 0, counted in rollout/env_errors, overruns also in rollout/env_timeouts); `run` never
raises for what the environment does, except when the environment cannot run this way at all (ConfigError)
or, with threads, when too many overrunning steps are still alive (EnvStuck).

process (the default): `workers` worker processes each hold a copy of the environment, pickled when the
pool first runs (after a resume's load_state_dict). Each job sends the episode with the reply; the worker
runs env.step on it and sends back the Turn and the episode's new `state`, which the trainer's Episode
takes. So the trainer's objects stay the only ones that matter: reset, start, reward, correct, evaluate,
prompt sampling and the checkpointed state_dict run on the trainer's environment, and what a step changes
on the environment object itself stays in its worker (keep per-episode state in `episode.state`). An
overrunning step is killed with its worker's process group (SIGKILL: no thread left running, no CPU spent
on it afterwards, subprocesses of the environment included) and a fresh worker replaces it; a step that
kills its worker fails the same way. Workers end with the trainer (killed at exit, and they kill
themselves if the trainer dies).

thread: the steps run on daemon threads of the trainer, on the trainer's own environment and episodes
(nothing is pickled: for an environment that cannot be copied into another process, e.g. a class defined
in `__main__` or one holding a live socket or client). Python cannot stop a thread: an overrunning step
is abandoned and keeps running (a busy loop keeps a core busy and takes GIL time from the trainer), so at
most ABANDONED_CAP abandoned steps may be alive at once, and one more stops the run with one line
(EnvStuck: the last step learned is saved). They never delay exit (daemon threads). rollout/env_abandoned
logs how many are alive. Steps of one turn run concurrently on the same environment object: its step
must not change shared attributes without a lock.

Why process is the default: only a process can be stopped, so only then does env_timeout bound what an
environment costs (a step with `while True: pass` is one killed process, not a core lost for the rest of
the run), and a step that crashes the interpreter (a segfault in an extension, os._exit) costs one episode
instead of the run. The price is a pickle of the episode per step (small: texts and the state) and one
process per worker (a Python interpreter plus the environment's imports); an environment that cannot be
pickled is refused at start with a line saying to set env_isolation: thread.

The same rule bounds the other calls into user code on the trainer's side (UserCalls, at the end of this file;
config user_code_timeout): a TRL reward function, an environment_factory's reset and get_reward, an environment's
finish, an OpenEnv, TextArena or SkyRL-gym reset, a user's task or environment class's reward, reset, start, evaluate
and the rest, a plain reward function's call (tasks/custom.py: UserCode, BoundedFunction). A module-level function
runs in a call worker process, killed at the limit; anything else runs on a daemon thread, abandoned at the limit,
and more than ABANDONED_CAP of those still running stop the run (UserCodeStuck, one line). An overrun raises
CallTimeout, which its caller counts like a raise.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import inspect
import io
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from llmrl.errors import ConfigError, EngineDied
from llmrl.grading import PARENT_PID, exit_with_parent, reap
from llmrl.tasks.env import Episode, Turn, call_step

ISOLATIONS = ("process", "thread")
ABANDONED_CAP = 4  # thread mode: overrunning steps that may still be running before the run stops
STARTUP_LIMIT = 300.0  # seconds a worker may take to import the environment's code and unpickle it
TIMEOUT = "timeout after"  # how an overrun's error text starts (episode_counts counts these)
HEADER = struct.Struct(">Q")  # frames: 8-byte length, then a pickle
READY = ("ready",)

Job = tuple[Episode, str]  # (episode, reply)
Result = Turn | str  # the step's checked Turn, or why the step failed


class EnvStuck(EngineDied):
    """Thread mode: more overrunning steps are still running than ABANDONED_CAP. The loop handles it as a
    dead engine: it saves the last step learned and stops with one line."""


def env_steps(isolation: str, env: Any, workers: int) -> ProcessSteps | ThreadSteps:
    """The step runner of a run: `process` workers or daemon `thread`s (see the module docstring)."""
    if isolation == "process":
        return ProcessSteps(env, workers)
    if isolation == "thread":
        return ThreadSteps(env, workers)
    raise ConfigError(f"env_isolation={isolation!r}: must be one of {', '.join(ISOLATIONS)}")


def error_text(e: BaseException) -> str:
    """What an exception says, for an episode's error; a CallTimeout's own text, which starts with TIMEOUT (so that an
    episode whose reset overran counts in rollout/env_timeouts)."""
    if isinstance(e, CallTimeout):
        return str(e)[:300]
    return f"{type(e).__name__}: {e}"[:300]


# ----------------------------------------------------------------------------- threads


class _ThreadJob:
    def __init__(self, episode: Episode, reply: str) -> None:
        self.episode, self.reply = episode, reply
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.started: float | None = None  # when a thread took it
        self.thread: threading.Thread | None = None
        self.result: Result | None = None
        self.abandoned = False


class ThreadSteps:
    """Steps on up to `workers` daemon threads of the trainer; overrunning ones are abandoned (at most
    ABANDONED_CAP alive at once, else EnvStuck)."""

    abandoned_cap = ABANDONED_CAP

    def __init__(self, env: Any, workers: int) -> None:
        self.env, self.n = env, max(1, workers)
        self.queue: queue.SimpleQueue[_ThreadJob | None] = queue.SimpleQueue()
        self.serving = 0  # threads taking jobs from the queue
        self.stuck: list[threading.Thread] = []  # threads of abandoned steps
        self.lock = threading.Lock()

    @property
    def abandoned(self) -> int:
        """Abandoned steps still running."""
        self.stuck = [t for t in self.stuck if t.is_alive()]
        return len(self.stuck)

    def _serve(self) -> None:
        while (job := self.queue.get()) is not None:
            with job.lock:
                job.started, job.thread = time.monotonic(), threading.current_thread()
            try:
                result: Result = call_step(self.env, job.episode, job.reply)
            except BaseException as e:  # noqa: BLE001 - a user's environment may raise anything
                result = error_text(e)
            with job.lock:
                if job.abandoned:
                    return  # its replacement serves in its place
                job.result = result
                job.done.set()

    def _add_thread(self) -> None:
        threading.Thread(target=self._serve, name="llmrl-env-step", daemon=True).start()
        self.serving += 1

    def run(self, jobs: list[Job], timeout: float) -> list[Result]:
        with self.lock:
            while self.serving < min(self.n, len(jobs)):
                self._add_thread()
            pending = [_ThreadJob(ep, reply) for ep, reply in jobs]
            for job in pending:
                self.queue.put(job)
            for job in pending:  # taken in order: a later job's deadline is checked when its turn comes
                while not job.done.is_set():
                    if job.started is None:
                        job.done.wait(0.01)  # still queued behind others
                        continue
                    if not job.done.wait(job.started + timeout - time.monotonic()):
                        with job.lock:
                            if not job.done.is_set():
                                job.abandoned, job.result = True, f"{TIMEOUT} {timeout:g} s (step abandoned on its thread)"
                                self.stuck.append(job.thread)  # type: ignore[arg-type]
                                self.serving -= 1
                                self._add_thread()
                        break
            alive = self.abandoned
        if alive > self.abandoned_cap:
            raise EnvStuck(f"{alive} environment steps overran env_timeout={timeout:g} s and are still running on "
                           f"threads (env_isolation=thread cannot stop them; at most {self.abandoned_cap}): fix the "
                           "environment's step, or use env_isolation=process (its steps are killed)")
        return [job.result for job in pending]  # type: ignore[misc]

    def close(self) -> None:
        with self.lock:
            for _ in range(self.serving):
                self.queue.put(None)
            self.serving = 0


# ----------------------------------------------------------------------------- processes


def write_frame(out, data: bytes) -> None:
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(stream) -> bytes | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    data = stream.read(n)
    return data if len(data) == n else None


def _load_modules(modules: list[tuple[str, str | None]]) -> None:
    """Import the environment's modules as the trainer has them: by name where that name finds the same
    file, else from the file itself (a `--task file.py:Name` module is not on any path)."""
    for name, file in modules:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if file is None or (spec is not None and spec.origin and _same_file(spec.origin, file)):
            importlib.import_module(name)
            continue
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # "built-in", "frozen", a file gone
        return False


def _worker_main() -> None:
    """A step worker (`python -c ...`, its own process group): a boot frame (sys.path, the modules to
    import, the pickled environment), then jobs (episode, reply) → ("ok", Turn, episode.state) |
    ("error", text) | ("unpicklable", text), one frame each, on the stdin/stdout pipes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    jobs = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the environment prints goes to stderr, not into the replies
    exit_with_parent(end=lambda: os.killpg(0, signal.SIGKILL))  # and what its environment started
    boot = read_frame(jobs)
    if boot is None:
        return
    try:
        path, modules, env_bytes = pickle.loads(boot)
        sys.path[:] = path
        _load_modules(modules)
        env = pickle.loads(env_bytes)
    except BaseException as e:  # noqa: BLE001 - the environment's code may fail to import in any way
        write_frame(replies, pickle.dumps(("failed", error_text(e))))
        return
    write_frame(replies, pickle.dumps(READY))
    while (frame := read_frame(jobs)) is not None:
        try:
            episode, reply = pickle.loads(frame)
            turn = call_step(env, episode, reply)
            out: tuple = ("ok", turn, episode.state)
        except BaseException as e:  # noqa: BLE001 - a user's environment may raise anything
            out = ("error", error_text(e))
        try:
            data = pickle.dumps(out)
        except Exception as e:  # noqa: BLE001 - the state may hold anything
            data = pickle.dumps(("unpicklable", f"the episode's state cannot be pickled back: {error_text(e)}"))
        write_frame(replies, data)


WORKER_COMMAND = "from llmrl.tasks.workers import _worker_main; _worker_main()"


class _Worker:
    """One worker process and the job it is running."""

    def __init__(self, boot: bytes, command: str = WORKER_COMMAND) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", command], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True,
                                        env={**os.environ, PARENT_PID: str(os.getpid())})
        self.fd = self.process.stdout.fileno()  # type: ignore[union-attr]
        self.buffer = b""
        self.job: tuple[int, float] | None = None  # (job index, when it was sent)
        self.started = time.monotonic()
        self.ready = False  # set when READY arrives; no job is sent before
        self.loaded: set[str] = set()  # a call worker: the modules it has imported
        try:
            self.send(boot)
        except OSError:
            pass  # it died at once: seen as its end of file

    def send(self, data: bytes) -> None:
        write_frame(self.process.stdin, data)

    def receive(self) -> list[Any]:
        """The frames that have arrived whole; EOFError if the worker has died."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            raise EOFError
        self.buffer += chunk
        frames = []
        while len(self.buffer) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buffer)
            if len(self.buffer) < HEADER.size + n:
                break
            frames.append(pickle.loads(self.buffer[HEADER.size: HEADER.size + n]))
            self.buffer = self.buffer[HEADER.size + n:]
        return frames

    def died(self) -> str:
        try:
            code = self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return "the environment worker died" + ("" if code is None else f" (exit code {code})")

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group: what the environment started dies too
        except (ProcessLookupError, PermissionError):
            pass
        reap(self.process)


class ProcessSteps:
    """Steps in up to `workers` worker processes, each with a copy of the environment; a step that
    overruns is killed with its worker, which is replaced. Thread-safe (one run at a time)."""

    abandoned = 0  # a killed step leaves nothing running

    def __init__(self, env: Any, workers: int) -> None:
        self.env, self.n = env, max(1, workers)
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.boot: bytes | None = None
        self._boot_frame()  # refuse an environment that cannot be pickled now, not at the first step
        self.boot = None  # the copy the workers get is taken at the first run (after a resume's load_state_dict)
        _POOLS.add(self)

    def _boot_frame(self) -> bytes:
        cls = type(self.env)
        hint = "set env_isolation: thread to run its steps in the trainer"
        # the environment's class and those it holds (worker_classes: e.g. a TRL environment_factory class, the class
        # of a user's environment that tasks/custom.py's UserCode holds)
        named = (cls, *getattr(self.env, "worker_classes", ()))
        main = next((k for k in named if k.__module__ == "__main__"), None)
        if main is not None:
            raise ConfigError(f"environment {main.__qualname__} is defined in __main__, so a step worker process "
                              f"cannot import it: define it in a module or file, or {hint}")
        classes = [c for k in named for c in reversed(k.__mro__)]
        modules = [(c.__module__, getattr(sys.modules.get(c.__module__), "__file__", None))
                   for c in classes if c.__module__ not in ("builtins", "__main__")]
        try:
            env_bytes = pickle.dumps(self.env)
        except Exception as e:  # noqa: BLE001 - whatever pickle refuses
            raise ConfigError(f"environment {cls.__qualname__} cannot be pickled into a step worker process "
                              f"({error_text(e)}): {hint}") from None
        return pickle.dumps((list(sys.path), list(dict.fromkeys(modules)), env_bytes))

    def _start(self) -> _Worker:
        if self.boot is None:
            self.boot = self._boot_frame()
        return _Worker(self.boot)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = self._start()

    def run(self, jobs: list[Job], timeout: float) -> list[Result]:
        """Per job its Turn (the episode's `state` is the worker's after the step) or why it failed. A
        job's time counts from when it is sent to a ready worker (one that has its environment)."""
        results: list[Result | None] = [None] * len(jobs)
        with self.lock:
            while len(self.workers) < min(self.n, len(jobs)):
                self.workers.append(self._start())
            todo = deque(range(len(jobs)))
            while todo or any(w.job for w in self.workers):
                for w in self.workers:
                    if w.ready and w.job is None and todo:
                        i = todo.popleft()
                        try:
                            data = pickle.dumps(jobs[i])
                        except Exception as e:  # noqa: BLE001 - the state may hold anything
                            raise ConfigError(f"an episode's state ({type(jobs[i][0].state).__name__}) cannot be "
                                              f"pickled to a step worker process ({error_text(e)}): set "
                                              "env_isolation: thread to run steps in the trainer") from None
                        try:
                            w.send(data)
                            w.job = (i, time.monotonic())
                        except OSError:
                            results[i] = w.died()
                            self._replace(w)
                waiting = [w for w in self.workers if w.job or (not w.ready and todo)]
                if not waiting:
                    continue
                deadline = min(w.job[1] + timeout if w.job else w.started + STARTUP_LIMIT for w in waiting)
                readable, _, _ = select.select([w.fd for w in waiting], [], [], max(0.0, deadline - time.monotonic()))
                for w in waiting:
                    if w.fd in readable:
                        try:
                            frames = w.receive()
                        except Exception:  # noqa: BLE001 - died (end of file) or sent what cannot be unpickled here
                            self._fail(w, todo, results, w.died())
                            continue
                        for frame in frames:
                            self._take(w, frame, jobs, results)
                    elif w.job and time.monotonic() - w.job[1] >= timeout:
                        results[w.job[0]] = f"{TIMEOUT} {timeout:g} s (its worker process was killed)"
                        self._replace(w)
                    elif not w.ready and time.monotonic() - w.started >= STARTUP_LIMIT:
                        self._fail(w, todo, results, f"the environment worker was not ready after {STARTUP_LIMIT:.0f} s")
        return results  # type: ignore[return-value]

    def _take(self, w: _Worker, frame: tuple, jobs: list[Job], results: list[Result | None]) -> None:
        if frame == READY:
            w.ready = True
        elif frame[0] == "failed":
            raise ConfigError(f"environment {type(self.env).__qualname__} cannot be rebuilt in a step worker process "
                              f"({frame[1]}): set env_isolation: thread to run its steps in the trainer")
        elif frame[0] == "unpicklable":
            raise ConfigError(f"{frame[1]}: set env_isolation: thread to run the environment's steps in the trainer")
        elif w.job is not None:
            i = w.job[0]
            if frame[0] == "ok":
                results[i] = frame[1]
                jobs[i][0].state = frame[2]
            else:
                results[i] = frame[1]
            w.job = None

    def _fail(self, w: _Worker, todo: deque, results: list, why: str) -> None:
        """A worker died or never started: its job (or, if it had none, the next queued one, so that a pool
        whose workers cannot start still ends) gets `why`; the worker is replaced."""
        i = w.job[0] if w.job else todo.popleft() if todo else None
        if i is not None:
            results[i] = why
        self._replace(w)

    def close(self) -> None:
        with self.lock:
            for w in self.workers:
                w.kill()
            self.workers = []


_POOLS: weakref.WeakSet[ProcessSteps] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS):
        pool.close()


# ----------------------------------------------------------------------------- calls into user code


USER_CODE_TIMEOUT = 120.0  # config user_code_timeout's default
_abandoned: list[tuple[threading.Thread, str]] = []  # overrunning calls on threads still running, and what each is
_abandoned_lock = threading.Lock()


class CallTimeout(Exception):
    """A call into user code overran its limit. Its text starts with TIMEOUT (error_text gives it as it is)."""


class CallFailed(Exception):
    """A call in a worker process raised something that cannot come back as itself (its text says what), or its
    worker died."""


class UserCodeStuck(EngineDied):
    """More calls into user code overran their limit on threads and are still running than ABANDONED_CAP. The loop
    handles it as a dead engine: it saves the last step learned and stops with one line."""


def abandoned_calls() -> list[str]:
    """What each overrunning call into user code still running on a thread (and counted) is."""
    with _abandoned_lock:
        _abandoned[:] = [(t, what) for t, what in _abandoned if t.is_alive()]
        return [what for _, what in _abandoned]


def check_stuck() -> None:
    """UserCodeStuck when more than ABANDONED_CAP overrunning calls are still running on threads: raised before a
    call starts another thread, and where a task draws its prompts (sample_train_batch, eval_examples), which
    nothing catches, so the run stops in one line at its next step."""
    alive = abandoned_calls()
    if len(alive) > ABANDONED_CAP:
        raise UserCodeStuck(f"{len(alive)} calls into user code overran user_code_timeout and are still running on "
                            f"threads (a thread cannot be stopped; at most {ABANDONED_CAP}; the last: {alive[-1]}): "
                            "fix the code that hangs, or let it run in a worker process, where an overrun is killed "
                            "(env_isolation=process, and a module-level function or a picklable environment_factory "
                            "class)")


def as_caller(fn: Any) -> Any:
    """fn, to run on another thread with what torch keeps per thread as the calling thread has it: grad mode and the
    current CUDA device (a new thread starts with grad on and device 0, so a user's reward model would build graphs,
    or land on another rank's GPU)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return fn
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> Any:
        if device is not None:
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad):
            return fn()

    return run


class Pending:
    """A call into user code on a daemon thread of the trainer, started at once (several run concurrently);
    `result()` waits for it until `timeout` seconds after its start. Past that the call is abandoned: it keeps
    running (Python cannot stop a thread), `late(value)` gets its value if it ever returns (to close what it
    opened), and while it runs it counts against ABANDONED_CAP, unless `counted` is False (a call that ends by
    itself, such as a network call under the client's own timeouts)."""

    def __init__(self, fn: Any, what: str, timeout: float, *, late: Any = None, counted: bool = True) -> None:
        self.what, self.timeout, self.late, self.counted = what, timeout, late, counted
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.thread = threading.Thread(target=self._run, args=(as_caller(fn),), name="llmrl-user-code", daemon=True)
        self.thread.start()

    def _run(self, fn: Any) -> None:
        try:
            value, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - user code may raise anything; result() raises it
            value, error = None, e
        with self.lock:
            self.value, self.error = value, error
            self.done.set()
            late = self.abandoned and error is None
        if late:
            self._late()

    def _late(self) -> None:
        if self.late is not None:
            try:
                self.late(self.value)
            except Exception:  # noqa: BLE001 - closing what nobody wanted any more: nothing to report to
                pass

    def result(self, wait: float | None = None) -> Any:
        """The call's value, or what it raised; CallTimeout at its deadline (or after `wait` seconds, if sooner),
        and then it is abandoned."""
        left = self.timeout - (time.monotonic() - self.started)
        if not self.done.wait(max(0.0, left if wait is None else min(left, wait))) and self.abandon():
            waited = min(self.timeout, round(time.monotonic() - self.started, 1))
            raise CallTimeout(f"{TIMEOUT} {waited:g} s ({self.what} abandoned on its thread)")
        if self.error is not None:
            raise self.error
        return self.value

    def abandon(self) -> bool:
        """Nobody waits for the result any more: `late` gets the value (at once if it is there). True if the call
        is still running."""
        with self.lock:
            if self.abandoned:
                return not self.done.is_set()
            self.abandoned = True
            running = not self.done.is_set()
            if running and self.counted:
                with _abandoned_lock:
                    _abandoned.append((self.thread, self.what))
        if not running and self.error is None:
            self._late()
        return running


class UserCalls:
    """Calls into user code on the trainer's side, each bounded by `timeout` seconds (config user_code_timeout)
    with the rule of an environment step: a call that overruns is killed, or abandoned where it cannot be, and
    fails with CallTimeout, which its caller counts like a raise (the completion or episode it was for scores 0).

        calls = UserCalls(timeout, isolation)          (tasks: task_from_config gives each its `user_calls`)
        value = calls.call("reward function f", fn, *args, **kwargs)    a worker process where it can
        value = calls.here("finish", obj.method, *args, **kwargs)       on a thread: the trainer's own objects
        pending = calls.start("a session", fn, *args, late=close); ...; pending.result()   several at once

    (`what` names the call in messages; it and fn are positional-only, so any keyword reaches fn.)

    `call` runs fn in a worker process (its own process group, SIGKILLed at the limit and replaced; the run's
    step workers' rule) when isolation is process, fn is a module-level function (pickled by name) and its
    arguments pickle without anything from `__main__`: what the call changes on its arguments stays in the
    worker, only its value comes back. Else (a callable object, a closure, something from `__main__`, code the
    worker cannot import, a value that cannot be pickled back, isolation thread) it runs as `here` does (a
    function whose call could not run in a worker, or whose value could not come back, is called again there,
    and its later calls stay on threads): on a daemon thread, abandoned at the limit;
    more than ABANDONED_CAP abandoned calls still running stop the run (UserCodeStuck). A judge's or a
    sandbox's call is one more `call` (or `start`, for calls that should overlap)."""

    def __init__(self, timeout: float = USER_CODE_TIMEOUT, isolation: str = "process",
                 step_timeout: float | None = None) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ConfigError(f"user_code_timeout={timeout!r}: must be a positive, finite number of seconds")
        self.timeout, self.isolation = float(timeout), isolation
        self.step_timeout = step_timeout  # env_timeout: how long a step may wait on a call started earlier

    def call(self, what: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if self.isolation == "process":
            job = _portable(fn, args, kwargs)
            if job is not None:
                try:
                    return _CALL_POOL.call(job, self.timeout, what)
                except _Unloadable:
                    _THREADED.add(_key(fn))  # its module cannot be imported in a worker: threads from now on
        return self.here(what, fn, *args, **kwargs)

    def here(self, what: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on a daemon thread of the trainer, within the limit (for calls on the trainer's own
        objects: a live client, an instance that must stay the trainer's). Every keyword reaches fn (a column or a
        row field named `late` or `counted` too)."""
        return self.start(what, functools.partial(fn, *args, **kwargs)).result()

    def start(self, what: str, fn: Any, /, *args: Any, late: Any = None, counted: bool = True,
              **kwargs: Any) -> Pending:
        """fn(*args, **kwargs) started now on a daemon thread (Pending: `late` and `counted` are its own)."""
        check_stuck()
        return Pending(lambda: fn(*args, **kwargs), what, self.timeout, late=late, counted=counted)


DEFAULT_CALLS = UserCalls()


def user_calls(owner: Any) -> UserCalls:
    """The UserCalls a task or environment was given (task_from_config: the config's limit), else the defaults."""
    return getattr(owner, "user_calls", None) or DEFAULT_CALLS


_THREADED: set[tuple[str, str]] = set()  # functions a worker could not import: they run on threads


class _Unloadable(Exception):
    pass


def _key(fn: Any) -> tuple[str, str]:
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", "")


class _Recording(pickle.Pickler):
    """A pickler that notes the module of every class and function it pickles by name."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: dict[str, None] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            self.modules[getattr(obj, "__module__", None) or "builtins"] = None
        return NotImplemented


def _portable(fn: Any, args: tuple, kwargs: dict) -> tuple[list[tuple[str, str | None]], bytes] | None:
    """(the modules a worker must import, the pickled call) when the call can run in a worker process, else None."""
    if not inspect.isfunction(fn) or "<" in fn.__qualname__ or fn.__module__ == "__main__" or _key(fn) in _THREADED:
        return None
    out = io.BytesIO()
    pickler = _Recording(out)
    try:
        pickler.dump((fn, args, kwargs))
    except Exception:  # noqa: BLE001 - whatever pickle refuses runs on a thread
        return None
    if "__main__" in pickler.modules:
        return None
    modules = [(m, getattr(sys.modules.get(m), "__file__", None)) for m in pickler.modules if m != "builtins"]
    return modules, out.getvalue()


CALL_WORKER_COMMAND = "from llmrl.tasks.workers import _call_worker_main; _call_worker_main()"


def _call_worker_main() -> None:
    """A call worker (`python -c ...`, its own process group): a boot frame (sys.path), then requests, one frame
    each: ("load", modules) → ("loaded",) | ("unloadable", text); ("call", pickled (fn, args, kwargs)) →
    ("ok", pickled value) | ("error", pickled exception or None, text) | ("unloadable", text) |
    ("unpicklable", text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the user's code prints goes to stderr, not into the replies
    exit_with_parent(end=lambda: os.killpg(0, signal.SIGKILL))
    boot = read_frame(requests)
    if boot is None:
        return
    sys.path[:] = pickle.loads(boot)
    write_frame(replies, pickle.dumps(READY))
    while (frame := read_frame(requests)) is not None:
        kind, body = pickle.loads(frame)
        out: tuple
        if kind == "load":
            try:
                _load_modules(body)
                out = ("loaded",)
            except BaseException as e:  # noqa: BLE001 - the user's module may fail to import in any way
                out = ("unloadable", error_text(e))
            write_frame(replies, pickle.dumps(out))
            continue
        try:
            fn, args, kwargs = pickle.loads(body)
        except BaseException as e:  # noqa: BLE001
            write_frame(replies, pickle.dumps(("unloadable", error_text(e))))
            continue
        try:
            value = fn(*args, **kwargs)
            try:
                out = ("ok", pickle.dumps(value))
            except Exception as e:  # noqa: BLE001 - the value may be anything
                out = ("unpicklable", f"its value cannot be pickled back to the trainer: {error_text(e)}")
        except BaseException as e:  # noqa: BLE001 - user code may raise anything
            try:
                raised = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                raised = None
            out = ("error", raised, error_text(e))
        write_frame(replies, pickle.dumps(out))


class _CallPool:
    """Call workers: each call takes an idle one (or starts one) for itself; one that overruns is killed with its
    process group and a fresh one started in its place."""

    keep = 4  # idle workers kept

    def __init__(self) -> None:
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()

    def _start(self) -> _Worker:
        return _Worker(pickle.dumps(list(sys.path)), CALL_WORKER_COMMAND)

    def _take(self) -> _Worker:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return self._start()

    def _give(self, w: _Worker) -> None:
        with self.lock:
            if len(self.idle) < self.keep:
                self.idle.append(w)
                return
        w.kill()

    @staticmethod
    def _reply(w: _Worker, limit: float) -> tuple | None:
        """The next frame from `w` within `limit` seconds (None: none came); EOFError if it died."""
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([w.fd], [], [], left)
            if readable:
                frames = w.receive()
                if frames:
                    return frames[0]

    def call(self, job: tuple[list[tuple[str, str | None]], bytes], timeout: float, what: str) -> Any:
        modules, data = job
        w = self._take()
        healthy = False
        try:
            if not w.ready:
                if self._reply(w, STARTUP_LIMIT) != READY:
                    raise CallFailed(f"{what}: its worker process was not ready after {STARTUP_LIMIT:.0f} s")
                w.ready = True
            new = [m for m in modules if m[0] not in w.loaded]
            if new:  # imported before the call's clock starts
                w.send(pickle.dumps(("load", new)))
                reply = self._reply(w, STARTUP_LIMIT)
                if reply is None:
                    raise CallFailed(f"{what}: its worker process could not import its modules in "
                                     f"{STARTUP_LIMIT:.0f} s")
                if reply[0] == "unloadable":
                    healthy = True
                    raise _Unloadable(reply[1])
                w.loaded.update(m for m, _ in new)
            w.send(pickle.dumps(("call", data)))
            reply = self._reply(w, timeout)
            if reply is None:
                raise CallTimeout(f"{TIMEOUT} {timeout:g} s ({what}; its worker process was killed)")
            healthy = True
        except (EOFError, OSError, pickle.UnpicklingError):
            raise CallFailed(f"{what}: {w.died()}") from None
        finally:
            if healthy:
                self._give(w)
            else:
                w.kill()
                self._give(self._start())  # a fresh one, importing while the trainer goes on
        kind = reply[0]
        if kind == "ok":
            return pickle.loads(reply[1])
        if kind in ("unloadable", "unpicklable"):  # it cannot run there, or its value cannot come back: a thread
            raise _Unloadable(reply[1])
        if kind == "error":
            try:
                raised = pickle.loads(reply[1]) if reply[1] is not None else None
            except Exception:  # noqa: BLE001 - an exception class the trainer does not have
                raised = None
            if isinstance(raised, Exception):
                raise raised
            raise CallFailed(reply[2])
        raise CallFailed(f"{what}: unexpected reply {kind!r}")

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for w in idle:
            w.kill()


_CALL_POOL = _CallPool()
atexit.register(_CALL_POOL.close)


def tried_at_start(thunk: Callable[[], Any], who: str, on: str, unit: str) -> tuple[bool, Any]:
    """A start-up check's one call into a user's reward function (`thunk`, bounded by user_code_timeout): (True, its
    value); (False, None) after one warning line when it overran (each `unit` it overruns then scores 0); one
    ConfigError line when it raised. `who` names the function, `on` what it was given."""
    try:
        return True, thunk()
    except CallTimeout as e:
        print(f"llmrl: warning: {who} did not score {on} within user_code_timeout ({e}); each {unit} it overruns "
              "scores 0 (reward/errors)", file=sys.stderr)
        return False, None
    except EngineDied:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise ConfigError(f"{who} raised {type(e).__name__}: {str(e)[:200]} on {on}; a reward function must score "
                          "any completion (return None for one it cannot score)") from None
