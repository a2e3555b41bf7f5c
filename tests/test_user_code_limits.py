"""Every call into user code on the trainer's side has a time limit (config user_code_timeout; tasks/workers.py:
UserCalls), with an environment step's kill-or-count rule: a TRL reward function, an environment_factory's reset
and get_reward, an environment's finish, an OpenEnv reset, a user's task or environment class (its reward, reset,
start, evaluate, draws and verdicts: tasks/custom.py UserCode) and a plain reward function (BoundedFunction). A
call that never returns ends at its limit: killed with its worker process (a module-level function), or abandoned on
its thread (anything else), and what it was for scores 0 and is counted; more abandoned calls still running than
the cap stop the run in one line. Also
here: OpenEnv's resets of a batch open at once, task_args message_timeout and user_code_timeout are checked, and
a dataset column that clashes with a reward function's keywords is refused at load."""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from helpers import read_jsonl, run_cli, tiny_args

LIMIT = 1.5  # user_code_timeout in these tests (seconds)

USER_CODE = '''
import os
import time


def spin(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    while True:
        pass


def double(x):
    return 2 * x


def where():
    return os.getpid()


def boom():
    raise ValueError("boom")


def stuck(prompts, completions, **columns):  # a TRL reward function that never returns
    while True:
        pass


def one(prompts, completions, **columns):
    return [1.0 for _ in completions]


class Game:
    """An environment_factory class whose reset or get_reward never returns on the rows that say so."""

    def __init__(self):
        self.mode = "ok"

    def reset(self, mode="ok", **row):
        self.mode = mode
        if mode == "reset":
            while True:
                pass

    def move(self, n: int) -> int:
        """Move.

        Args:
            n: how far
        """
        return n

    def get_reward(self):
        if self.mode == "reward":
            time.sleep(10**9)
        return 1.0
'''


@pytest.fixture
def code(tmp_path) -> Path:
    path = tmp_path / "user_code.py"
    path.write_text(USER_CODE)
    return path


def rows_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stopped_lines(stderr: str) -> list[str]:
    """The lines that end a run (`llmrl: stopped: ...`, `llmrl: error: ...`; not the start-up's notes)."""
    lines = stderr.replace("\r", "\n").splitlines()
    return [line for line in lines if line.startswith(("llmrl: stopped", "llmrl: error"))]


def test_a_call_that_never_returns_is_killed_with_its_worker_and_the_next_call_runs(code, tmp_path):
    """A module-level function runs in a worker process: a busy loop is SIGKILLed at the limit (its process is gone:
    no CPU spent on it afterwards), the next call gets a fresh worker; an exception comes back as itself. What
    cannot go to a process (a lambda) runs on a thread; on a thread an overrun is abandoned and counted."""
    from llmrl.tasks.custom import load_object
    from llmrl.tasks.workers import TIMEOUT, CallTimeout, UserCalls, abandoned_calls, error_text

    calls = UserCalls(LIMIT, "process")
    spin, double, where, boom = (load_object(f"{code}:{name}") for name in ("spin", "double", "where", "boom"))
    assert calls.call("double", double, 21) == 42
    assert calls.call("where", where) != os.getpid()  # another process
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    with pytest.raises(CallTimeout) as e:
        calls.call("reward function spin", spin, str(pid_file))
    assert time.monotonic() - t0 < 10 * LIMIT
    assert str(e.value) == f"{TIMEOUT} {LIMIT:g} s (reward function spin; its worker process was killed)"
    assert error_text(e.value) == str(e.value)  # an episode it ends counts in rollout/env_timeouts
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert calls.call("double", double, 4) == 8  # a fresh worker
    with pytest.raises(ValueError, match="boom"):
        calls.call("boom", boom)
    assert calls.call("a lambda", lambda: threading.current_thread().name) == "llmrl-user-code"

    on_thread = UserCalls(0.3, "thread")
    assert on_thread.call("where", where) == os.getpid()
    with pytest.raises(CallTimeout, match=r"^timeout after 0\.3 s \(a sleep abandoned on its thread\)$"):
        on_thread.call("a sleep", time.sleep, 2)
    assert abandoned_calls() == ["a sleep"]
    for _ in range(100):
        if not abandoned_calls():
            break
        time.sleep(0.1)
    assert abandoned_calls() == []  # it ended by itself: no longer counted


def test_more_abandoned_calls_than_the_cap_stop_the_run_where_it_draws_prompts(code, tmp_path):
    """Five calls abandoned on threads and still running: the next call is refused without starting a thread, and a
    task's next draw raises UserCodeStuck (an EngineDied: the loop saves and stops in one line). Once they end, the
    task draws again."""
    from llmrl.config import load_config
    from llmrl.errors import EngineDied
    from llmrl.tasks import task_from_config
    from llmrl.tasks.workers import ABANDONED_CAP, CallTimeout, UserCalls, UserCodeStuck, abandoned_calls

    rows = rows_file(tmp_path / "rows.jsonl", [{"prompt": f"Say {k}."} for k in range(4)])
    task = task_from_config(load_config(None, {"dataset": str(rows), "reward_funcs": f"{code}:one"}))
    calls = UserCalls(0.2, "thread")
    for _ in range(ABANDONED_CAP + 1):
        with pytest.raises(CallTimeout):
            calls.here("a slow cleanup", time.sleep, 3)
    with pytest.raises(UserCodeStuck, match=r"^5 calls into user code overran user_code_timeout and are still running"):
        calls.here("another", lambda: None)
    with pytest.raises(EngineDied, match="the last: a slow cleanup"):
        task.sample_train_batch(2)
    for _ in range(100):
        if not abandoned_calls():
            break
        time.sleep(0.1)
    assert len(task.sample_train_batch(2)) == 2


@pytest.mark.slow
def test_a_reward_function_that_never_returns_scores_its_batches_0_counted_and_the_run_ends(code, tmp_path,
                                                                                           tiny_model_dir):
    """A TRL reward function with `while True: pass`: each batch's call is killed at user_code_timeout, its
    completions score 0 and are counted (reward/errors, eval/reward_errors), once each (no call per completion
    after the batch's), and the run ends normally: no traceback."""
    rows = rows_file(tmp_path / "rows.jsonl", [{"prompt": f"Say {w}.", "level": k} for k, w in enumerate("abcdefghij")])
    out = tmp_path / "run"  # 10 rows: eval's 2 are the 20% a hold-out may take
    t0 = time.monotonic()
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=1, task="dataset", eval_n=2, eval_interval=0),
                "--dataset", str(rows), "--reward_funcs", f"{code}:stuck", "--user_code_timeout", str(LIMIT))
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert [(r["step"], r["reward/errors"], r["reward/mean"]) for r in train] == [(1, 6, 0.0)]
    evals = [r for r in records if "eval/reward_errors" in r]
    assert [(r["step"], r["eval/reward_errors"], r["eval/reward"]) for r in evals] == [(1, 2, 0.0)]
    assert [s["reward"] for s in read_jsonl(out / "samples.jsonl")] == [0.0] * 6
    assert wall < 2 * 10 * LIMIT + 120  # 2 calls (the step's, the eval's), each ended at its limit; the run itself


@pytest.mark.slow
def test_an_environment_factory_reset_or_get_reward_that_never_returns_costs_its_episodes(code, tmp_path,
                                                                                         tiny_model_dir):
    """An environment_factory class whose reset busy-loops on some rows and whose get_reward sleeps for ever on
    others (env_isolation process: both killed with their worker): a reset's group ends before its first reply
    (rollout/env_errors and rollout/env_timeouts, reward 0), a get_reward's episode scores 0 (reward/errors); the
    other rows' episodes score 1; the run ends, no traceback."""
    modes = ["ok", "reset", "reward"] * 3
    rows = rows_file(tmp_path / "rows.jsonl", [{"prompt": f"Row {k} ({m}).", "mode": m} for k, m in enumerate(modes)])
    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task="dataset", group_size=2, minibatch_size=2,
                           batch_size=3, eval_n=1, eval_interval=0, max_prompt_tokens=200),
                "--dataset", str(rows), "--environment_factory", f"{code}:Game", "--chat_template", "chatml-tools",
                "--max_turns", "1", "--eval_holdout", "1", "--user_code_timeout", str(LIMIT))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 3 * 2

    def mode(sample: dict) -> str:  # a reset that failed leaves the episode an empty prompt
        return "reset" if sample["prompt"] == "" else sample["prompt"].rpartition("(")[2].rstrip(").")

    assert all(s["reward"] == (1.0 if mode(s) == "ok" else 0.0) for s in samples)
    errors = 0
    for step, record in enumerate(train):
        mine = [mode(s) for s in samples[6 * step: 6 * step + 6]]
        assert record["rollout/env_timeouts"] == record["rollout/env_errors"] == mine.count("reset")
        errors += mine.count("reward")
        assert record["reward/errors"] == errors
    assert {mode(s) for s in samples} == {"ok", "reset", "reward"}  # each kind happened (the seed's draw)


def test_on_threads_an_overrunning_get_reward_is_abandoned_and_the_fifth_still_running_stops_the_run(
        code, tmp_path, tiny_model_dir):
    """env_isolation thread: get_reward cannot be killed, so each overrun is abandoned; with more than 4 still
    running the run stops with one line (`llmrl: stopped: ...`, a checkpoint named), no traceback."""
    rows = rows_file(tmp_path / "rows.jsonl", [{"prompt": f"Row {k}.", "mode": "reward"} for k in range(4)])
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=3, task="dataset", eval_n=1, eval_interval=0,
                           max_prompt_tokens=200),
                "--dataset", str(rows), "--environment_factory", f"{code}:Game", "--chat_template", "chatml-tools",
                "--max_turns", "1", "--env_isolation", "thread", "--user_code_timeout", "1")
    wall = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    lines = stopped_lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith("llmrl: stopped: 5 calls into user code overran user_code_timeout")
    assert "checkpoint" in lines[0] and "get_reward" in lines[0], lines[0]
    assert wall < 5 * 10 * 1 + 120


def test_an_openenv_tasks_message_timeout_must_be_a_positive_finite_number():
    from llmrl.errors import ConfigError
    from llmrl.tasks import make_task

    for bad in (float("inf"), float("nan"), -1.0, 0, "60", True, None):
        with pytest.raises(ConfigError, match=r"^task openenv:http://127\.0\.0\.1:9: task_args message_timeout="):
            make_task("openenv:http://127.0.0.1:9", seed=0, task_args={"message_timeout": bad})


def test_user_code_timeout_must_be_a_positive_finite_number(tmp_path, tiny_model_dir):
    from llmrl.config import load_config
    from llmrl.errors import ConfigError
    from llmrl.tasks.workers import UserCalls

    assert load_config(None, {}).user_code_timeout == 120.0
    for bad in ("inf", "nan", "-1", "0", "soon", "3601"):
        with pytest.raises(ConfigError, match=r"^user_code_timeout"):
            load_config(None, {"user_code_timeout": bad})
    for bad in (float("inf"), 0.0, -2.0, "1"):
        with pytest.raises(ConfigError, match=r"^user_code_timeout="):
            UserCalls(bad)
    p = run_cli(*tiny_args(tiny_model_dir, tmp_path / "run", "grpo"), "--user_code_timeout", "inf")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "user_code_timeout=inf" in p.stderr, p.stderr[-2000:]


def test_a_column_named_like_a_reward_functions_keyword_is_refused_at_load(code, tmp_path):
    """A column `prompts` or `completions` would clash with the keywords a TRL reward function gets (every call a
    TypeError): with reward_funcs it is one line at load; without them the column is data like any other. With an
    environment_factory scored by reward functions, `environments` too."""
    from llmrl.config import load_config
    from llmrl.errors import DataError
    from llmrl.tasks import task_from_config

    for column in ("prompts", "completions"):
        rows = rows_file(tmp_path / f"{column}.jsonl", [{"prompt": f"Say {k}.", "answer": "1", column: "x"}
                                                        for k in range(3)])
        with pytest.raises(DataError, match=rf"^dataset '{rows}': a column is named '{column}', the keyword"):
            task_from_config(load_config(None, {"dataset": str(rows), "reward_funcs": f"{code}:one"}))
        task_from_config(load_config(None, {"dataset": str(rows), "grader": "exact"}))  # a grader: no keywords
    rows = rows_file(tmp_path / "env.jsonl", [{"prompt": f"Say {k}.", "environments": "x"} for k in range(3)])
    with pytest.raises(DataError, match=r"a column is named 'environments'"):
        task_from_config(load_config(None, {"dataset": str(rows), "reward_funcs": f"{code}:one",
                                            "environment_factory": f"{code}:Game"}))


SLOW_SERVER = '''
import sys
import time

sys.path.insert(0, {tests!r})
import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv_digit_server import DigitGame, GuessAction, GuessObservation


class SlowGame(DigitGame):
    """A reset takes 1.5 s; one whose seed is 1 mod 3 never returns (seed 0, the task's probe, is a slow one)."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        time.sleep(600 if (seed or 0) % 3 == 1 else 1.5)
        return super().reset(seed=seed, episode_id=episode_id, **kwargs)


app = create_app(SlowGame, GuessAction, GuessObservation, env_name="slow", max_concurrent_envs=64)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


@pytest.fixture
def slow_server(tmp_path):
    """A local OpenEnv server whose resets are slow or never return; its URL."""
    pytest.importorskip("openenv")
    import socket
    import subprocess
    import sys
    import urllib.request

    script = tmp_path / "slow_server.py"
    script.write_text(SLOW_SERVER.format(tests=str(Path(__file__).parent)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # the server's imports on a loaded machine
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()[-2000:]
                time.sleep(0.1)
        yield url
    finally:
        server.kill()
        server.wait()


def test_openenv_resets_of_a_batch_open_together_and_one_that_never_returns_ends_at_the_limit(slow_server):
    """Eight resets of 1.5 s each and one that never returns: one after another they would take 12 s plus the
    limit; opened together, the batch takes about the limit. The one that overruns raises CallTimeout (its
    episodes end as an env_error counted in rollout/env_timeouts); a group's other episodes' sessions open at
    `start` and their first step waits for them."""
    from llmrl.tasks import give_user_calls, make_task
    from llmrl.tasks.env import Episode
    from llmrl.tasks.workers import TIMEOUT, CallTimeout, Pending, UserCalls

    limit = 4.0
    env = make_task(f"openenv:{slow_server}", seed=0, task_args={"message_timeout": 30})
    give_user_calls(env, UserCalls(limit, "thread", 30.0))
    seeds = [2, 3, 5, 6, 8, 9, 11, 12, 13]  # 13 is 1 mod 3: it never returns
    examples = env.expect([env.example(s) for s in seeds])
    t0 = time.monotonic()
    firsts = []
    for ex in examples[:-1]:
        firsts.append(env.reset(ex))
    with pytest.raises(CallTimeout, match=rf"^{TIMEOUT} 4 s \(OpenEnv {slow_server}: opening a session abandoned"):
        env.reset(examples[-1])
    wall = time.monotonic() - t0
    assert wall < 8 * 1.5  # together: less than the 8 slow resets one after another (about `limit` when idle)
    assert all(f[-1]["content"].startswith("Guess my digit") for f in firsts)
    ep = Episode(example=examples[0], messages=list(firsts[0]), first=len(firsts[0]))
    other = Episode(example=examples[0], messages=list(firsts[0]), first=len(firsts[0]))
    env.start(ep)
    env.start(other)
    assert isinstance(other.state, Pending) and not isinstance(ep.state, Pending)
    assert env.step(other, str(2 % 10)).messages is None  # the right digit: its session opened, and was reset
    for e in (ep, other):
        env.finish(e)


# ----------------------------------------------------------------------------- a user's task and environment classes

TASK_CODE = '''
import random
import time

from llmrl.tasks.base import Example, Reward, SeededSampling
from llmrl.tasks.env import Environment, Turn


def example(i):
    return Example(messages=[{"role": "user", "content": f"Say something about {i}."}], answer=i)


class Slow(SeededSampling):
    """A task whose calls take `sleep` seconds when the completion (or, for the others, the task) says "slow"."""

    name = "slow"
    eval_n_default = 2

    def __init__(self, seed=0, mode="", sleep=2.0):
        self.rng, self.mode, self.sleep = random.Random(seed), mode, sleep
        self.reward_calls = 0

    def sample_train_batch(self, n):
        if self.mode == "draw":
            time.sleep(self.sleep)
        return [example(self.rng.randint(0, 99)) for _ in range(n)]

    def eval_examples(self, n):
        return [example(i) for i in range(n)]

    def reward(self, example, completion):
        self.reward_calls += 1
        if completion == "slow":
            time.sleep(self.sleep)
        return Reward(total=1.0, components={"said": 1.0})

    def evaluate(self, examples, completions):
        if self.mode == "evaluate":
            time.sleep(self.sleep)
        return {"said": 1.0}


class SlowBatch(Slow):
    """Its reward_batch overruns; `reward` alone would give 1.0."""

    def reward_batch(self, examples, completions):
        time.sleep(self.sleep)
        return [Reward(total=1.0, components={"said": 1.0}) for _ in completions]


class Signals(Slow):
    """Its reward sets a signal handler, as math-verify's timeouts do: Python allows that on the main thread only."""

    def reward(self, example, completion):
        import signal

        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
        return super().reward(example, completion)


class Hangs(SeededSampling):
    """CharTask's prompts and reward; its reward never returns on its first call (mode once) or on any (always)."""

    name = "hangs"
    eval_n_default = 2

    def __init__(self, seed=0, mode="once"):
        self.rng, self.mode, self.calls = random.Random(seed), mode, 0

    def sample_train_batch(self, n):
        return [example(self.rng.randint(0, 99)) for _ in range(n)]

    def eval_examples(self, n):
        return [example(i) for i in range(n)]

    def reward(self, example, completion):
        self.calls += 1
        if self.mode == "always" or self.calls == 1:
            time.sleep(10**6)
        distinct = len(set(completion)) / max(len(completion), 1)
        return Reward(total=0.5 + distinct / 4, components={"distinct": distinct})

    def evaluate(self, examples, completions):
        return {}


class Stalls(SeededSampling, Environment):
    """A one-turn environment whose reset or reward (`hang`) never returns on its first call; 1.0 otherwise."""

    name = "stalls"
    eval_n_default = 2
    max_turns = 1

    def __init__(self, seed=0, hang="reset", sleep=10**6):
        super().__init__(seed)
        self.rng, self.hang, self.sleep, self.calls = random.Random(seed), hang, sleep, 0

    def sample_train_batch(self, n):
        return [example(self.rng.randint(0, 99)) for _ in range(n)]

    def eval_examples(self, n):
        return [example(i) for i in range(n)]

    def stall(self, where):
        if where == self.hang:
            self.calls += 1
            if self.calls == 1:
                time.sleep(self.sleep)

    def reset(self, example):
        self.stall("reset")
        return list(example.messages)

    def start(self, episode):
        self.stall("start")
        episode.state = {"started": True}

    def step(self, episode, reply):
        return Turn(None, {"said": 1.0})

    def reward(self, episode):
        self.stall("reward")
        return Reward(total=1.0, components={"said": 1.0})

    def correct(self, episode):
        self.stall("correct")
        return True


def slow_fn(prompt, completion, **meta):
    if completion == "slow":
        while True:
            pass
    return 1.0


class SlowInit:
    """An environment_factory class whose constructor takes 2 s."""

    def __init__(self):
        time.sleep(2)

    def reset(self, **row):
        return None

    def move(self, n: int) -> int:
        """Move.

        Args:
            n: how far
        """
        return n

    def get_reward(self):
        return 1.0
'''


@pytest.fixture
def task_code(tmp_path) -> Path:
    path = tmp_path / "user_tasks.py"
    path.write_text(TASK_CODE)
    return path


def settle() -> None:
    """Wait until the calls these tests abandoned (finite sleeps) have ended: nothing is left counted for the next."""
    from llmrl.tasks.workers import abandoned_calls

    for _ in range(100):
        if not abandoned_calls():
            return
        time.sleep(0.1)
    assert abandoned_calls() == []


def test_in_a_run_the_users_classes_and_functions_are_bounded_and_llmrls_own_tasks_are_called_directly(
        task_code, tmp_path, monkeypatch):
    """make_task given a run's UserCalls (task_from_config) decides what is the user's: a spec's class (UserCode), a
    reward function (BoundedFunction), a class registered with register_env; llmrl's own tasks come back as
    themselves and score, step and finish on the trainer's thread (no thread per call: a Pending would fail here).
    Outside a run (no calls), make_task gives the user's objects themselves."""
    from llmrl.tasks import TASKS, make_task, register_env
    from llmrl.tasks import workers
    from llmrl.tasks.custom import BoundedFunction, FunctionTask, UserCode
    from llmrl.tasks.env import Episode
    from llmrl.tasks.format_copy import FormatCopyTask
    from llmrl.tasks.guess import GuessEnv
    from llmrl.tasks.score import score, score_episodes

    calls = workers.UserCalls(5.0, "thread")
    prompts = rows_file(tmp_path / "prompts.jsonl", [{"prompt": "Say hi."}])
    user = make_task(f"{task_code}:Slow", seed=3, calls=calls)
    assert isinstance(user, UserCode) and user.rng.random() == __import__("random").Random(3).random()
    assert type(make_task(f"{task_code}:Slow", seed=3)).__name__ == "Slow"  # outside a run: itself
    fn_task = make_task(f"{task_code}:slow_fn", seed=0, prompts=str(prompts), calls=calls)
    assert isinstance(fn_task, FunctionTask) and isinstance(fn_task.fn, BoundedFunction)
    monkeypatch.setitem(TASKS, "stalls-env", None)  # the registry loses it again after the test
    register_env("stalls-env", type(make_task(f"{task_code}:Stalls", seed=0)))
    assert isinstance(make_task("stalls-env", seed=0, calls=calls), UserCode)

    class NoThread:
        def __init__(self, *args, **kwargs):
            raise AssertionError("llmrl's own task called on a thread")

    monkeypatch.setattr(workers, "Pending", NoThread)
    fc = make_task("format_copy", seed=0, calls=calls)
    assert type(fc) is FormatCopyTask
    examples = fc.eval_examples(2)
    scores = score(fc, examples, [f"<answer>{examples[0].answer}</answer>", "no"], strict=False, where="eval")
    assert scores.errors == 0 and scores.rewards[0].total > scores.rewards[1].total
    guess = make_task("guess", seed=0, calls=calls)
    assert type(guess) is GuessEnv
    ex = GuessEnv.example(7)
    ep = Episode(ex, list(ex.messages), first=len(ex.messages))
    guess.start(ep)
    ep.replies += 1
    guess.step(ep, "<guess>7</guess>")
    assert score_episodes(guess, [ep], strict=False, where="eval").errors == 0  # its finish: nothing to call


def test_a_user_tasks_reward_that_overruns_scores_0_and_is_counted_once(task_code):
    """A user task's reward that overruns: CallTimeout, the completion scores 0 with the count `timeouts` (reward/
    timeouts; reward/errors), the others score as usual. A reward_batch that overruns: its completions score 0 and
    are not asked again one at a time (each `reward` alone would give 1.0). evaluate's overrun is a CallTimeout (eval
    warns in one line); a draw's or a verdict's stops the run (UserCodeOverran, an EngineDied)."""
    from llmrl.errors import EngineDied
    from llmrl.tasks import make_task
    from llmrl.tasks.custom import UserCodeOverran
    from llmrl.tasks.score import score
    from llmrl.tasks.workers import TIMEOUT, CallTimeout, UserCalls

    calls = UserCalls(0.3, "thread")
    task = make_task(f"{task_code}:Slow", seed=0, calls=calls)
    examples = task.eval_examples(3)
    t0 = time.monotonic()
    scores = score(task, examples, ["fine", "slow", "fine"], strict=False, where="step 1")
    assert time.monotonic() - t0 < 10 * 0.3 + 5
    assert [r.total for r in scores.rewards] == [1.0, 0.0, 1.0]
    assert (scores.errors, scores.timeouts, scores.rewards[1].counts) == (1, 1, {"timeouts": 1})
    assert scores.rewards[0].counts == {}
    with pytest.raises(CallTimeout, match=rf"^{TIMEOUT} 0\.3 s \(task {task_code}:Slow: reward abandoned on its thread"):
        task.reward(examples[0], "slow")

    batch = make_task(f"{task_code}:SlowBatch", seed=0, calls=calls)
    t0 = time.monotonic()
    scores = score(batch, examples, ["a", "b", "c"], strict=False, where="step 1")
    assert time.monotonic() - t0 < 10 * 0.3 + 5
    assert [r.total for r in scores.rewards] == [0.0] * 3 and (scores.errors, scores.timeouts) == (3, 3)
    assert batch.reward_calls == 0  # not asked again one completion at a time

    with pytest.raises(CallTimeout):
        make_task(f"{task_code}:Slow", seed=0, task_args={"mode": "evaluate"}, calls=calls).evaluate(examples, ["a"] * 3)
    drawing = make_task(f"{task_code}:Slow", seed=0, task_args={"mode": "draw"}, calls=calls)
    with pytest.raises(UserCodeOverran, match=rf"^task {task_code}:Slow: sample_train_batch did not return within "
                                              r"user_code_timeout=0\.3 s") as e:
        drawing.sample_train_batch(2)
    assert isinstance(e.value, EngineDied) and "\n" not in str(e.value)
    settle()


def test_a_reward_that_sets_signal_handlers_runs_on_the_main_thread_with_one_warning(task_code, capsys):
    """Signal handlers can only be set on the main thread (math-verify's parse and verify set one for their timeouts):
    such a reward, refused on its thread, is called again on the trainer's main thread, and stays there (one warning
    line); its scores are what they were before calls were bounded."""
    from llmrl.tasks import make_task
    from llmrl.tasks.score import score
    from llmrl.tasks.workers import UserCalls

    task = make_task(f"{task_code}:Signals", seed=0, calls=UserCalls(5.0, "thread"))
    examples = task.eval_examples(3)
    scores = score(task, examples, ["a", "b", "c"], strict=True, where="step 1")
    assert [r.total for r in scores.rewards] == [1.0] * 3 and scores.errors == 0
    assert task.reward_calls == 3  # the refused call raised before it counted; each later one ran once
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmrl: warning")]
    assert len(warnings) == 1 and f"task {task_code}:Signals: reward sets signal handlers" in warnings[0]


def test_a_plain_reward_functions_overrun_is_killed_and_not_asked_again_by_its_evaluate(task_code, tmp_path):
    """A reward function task (--task file.py:fn --prompts): with env_isolation process a module-level function runs in
    a worker process, killed at the limit; the completion scores 0 and is counted; the task's evaluate does not ask
    the function again for the completion that overran (it counts it unscored)."""
    from llmrl.tasks import make_task
    from llmrl.tasks.score import score
    from llmrl.tasks.workers import UserCalls

    prompts = rows_file(tmp_path / "prompts.jsonl", [{"prompt": f"Say {k}."} for k in range(2)])
    task = make_task(f"{task_code}:slow_fn", seed=0, prompts=str(prompts), calls=UserCalls(LIMIT, "process"))
    examples = task.eval_examples(2)
    t0 = time.monotonic()
    scores = score(task, examples, ["fine", "slow"], strict=False, where="eval")
    assert [r.total for r in scores.rewards] == [1.0, 0.0] and (scores.errors, scores.timeouts) == (1, 1)
    assert len(task.fn.overruns.seen) == 1
    assert task.evaluate(examples, ["fine", "slow"]) == {"scored": 0.5}
    assert len(task.fn.overruns.seen) == 1  # the call that overran was not made again (it would overrun again)
    assert time.monotonic() - t0 < 10 * LIMIT + 60  # one limit, and a worker process's start


def test_a_user_environments_reset_start_reward_and_correct_are_bounded(task_code):
    """A user environment (a spec's class): reset, start and reward that overrun raise CallTimeout (an episode's
    error text starts with TIMEOUT: rollout/env_timeouts), scoring counts a reward's (score_episodes: 0, reward/
    timeouts); correct's stops the run. Its steps are not bounded here (env_timeout is theirs), and a step worker
    process gets the environment itself."""
    import pickle

    from llmrl.tasks import make_task
    from llmrl.tasks.custom import UserCodeOverran
    from llmrl.tasks.env import Episode, Turn
    from llmrl.tasks.score import score_episodes
    from llmrl.tasks.workers import TIMEOUT, CallTimeout, UserCalls, env_steps, error_text

    calls = UserCalls(0.3, "thread")

    def env(hang):
        return make_task(f"{task_code}:Stalls", seed=0, task_args={"hang": hang, "sleep": 2}, calls=calls)

    ex = env("").eval_examples(1)[0]
    for hang in ("reset", "start"):
        e = env(hang)
        with pytest.raises(CallTimeout) as raised:
            e.reset(ex) if hang == "reset" else e.start(Episode(ex, list(ex.messages)))
        assert error_text(raised.value).startswith(TIMEOUT)
    e = env("reward")
    episodes = [Episode(ex, list(ex.messages), first=1) for _ in range(2)]
    scores = score_episodes(e, episodes, strict=False, where="step 1")
    assert [r.total for r in scores.rewards] == [0.0, 1.0] and (scores.errors, scores.timeouts) == (1, 1)
    with pytest.raises(UserCodeOverran, match=rf"^environment {task_code}:Stalls: correct did not return"):
        env("correct").correct(episodes[0])

    plain = env("")
    assert type(pickle.loads(pickle.dumps(plain))).__name__ == "Stalls"
    steps = env_steps("process", plain, 1)
    try:
        ep = Episode(ex, list(ex.messages), first=1)
        assert steps.run([(ep, "hi")], 60.0) == [Turn(None, {"said": 1.0})]
    finally:
        steps.close()
    settle()


def test_an_environment_factory_whose_constructor_overruns_at_start_up_is_one_line(task_code, tmp_path):
    from llmrl.config import load_config
    from llmrl.errors import ConfigError
    from llmrl.tasks import task_from_config

    rows = rows_file(tmp_path / "rows.jsonl", [{"prompt": f"Say {k}."} for k in range(3)])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^environment_factory='{task_code}:SlowInit': building an instance did "
                                          r"not end: timeout after 0\.3 s") as e:
        task_from_config(load_config(None, {"dataset": str(rows), "environment_factory": f"{task_code}:SlowInit",
                                            "user_code_timeout": "0.3"}))
    assert time.monotonic() - t0 < 10 * 0.3 + 5 and "\n" not in str(e.value)
    settle()


@pytest.mark.slow
def test_a_user_tasks_reward_that_never_returns_scores_0_counted_and_the_run_ends(task_code, tmp_path,
                                                                                 tiny_model_dir):
    """--task file.py:Hangs, whose reward's first call never returns: that completion scores 0, counted in
    reward/errors and reward/timeouts at step 1; the other completions and steps score as usual; no traceback."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=f"{task_code}:Hangs", eval_interval=0),
                "--user_code_timeout", str(LIMIT))
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [(r["step"], r["reward/errors"], r.get("reward/timeouts")) for r in train] == [(1, 1, 1), (2, 1, None)]
    rewards = [s["reward"] for s in read_jsonl(out / "samples.jsonl")]
    assert rewards[0] == 0.0 and all(r >= 0.5 for r in rewards[1:]), rewards
    assert wall < 10 * LIMIT + 120


@pytest.mark.slow
def test_a_user_tasks_reward_that_never_returns_anywhere_stops_the_run_in_one_line(task_code, tmp_path,
                                                                                  tiny_model_dir):
    """Every reward call never returns: each is abandoned at the limit, and with more than 4 still running the run
    stops with one line (`llmrl: stopped: ...`, a checkpoint named), no traceback."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=f"{task_code}:Hangs", eval_interval=0),
                "--task_args", '{"mode": "always"}', "--user_code_timeout", "1")
    wall = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    lines = stopped_lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith("llmrl: stopped: 5 calls into user code overran user_code_timeout")
    assert "checkpoint" in lines[0] and "reward" in lines[0], lines[0]
    assert wall < 5 * 10 * 1 + 120


@pytest.mark.slow
@pytest.mark.parametrize("hang", ["reset", "reward"])
def test_a_user_environments_reset_or_reward_that_never_returns_costs_its_episodes(task_code, tmp_path,
                                                                                  tiny_model_dir, hang):
    """--task file.py:Stalls, whose first reset (or reward) never returns: that group's episodes end before their
    first reply (reset: rollout/env_errors = rollout/env_timeouts = 3, reward 0), or that episode scores 0 (reward:
    reward/errors, reward/timeouts); every other episode scores 1; the run ends, no traceback."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=f"{task_code}:Stalls", eval_interval=0),
                "--task_args", json.dumps({"hang": hang}), "--user_code_timeout", str(LIMIT))
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    lost = 3 if hang == "reset" else 1
    assert [s["reward"] for s in read_jsonl(out / "samples.jsonl")] == [0.0] * lost + [1.0] * (12 - lost)
    timeouts = [(r["rollout/env_errors"], r["rollout/env_timeouts"], r["reward/errors"], r.get("reward/timeouts"))
                for r in train]
    assert timeouts == ([(3, 3, 0, None), (0, 0, 0, None)] if hang == "reset" else [(0, 0, 1, 1), (0, 0, 1, None)])
    assert wall < 10 * LIMIT + 120
