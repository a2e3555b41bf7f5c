"""Grading math answers: extract the boxed answer, decide equivalence with math-verify, in bounded time.

    verdicts = grade_batch([(completion, gold), ...])      # gold: an answer, e.g. "\\frac{1}{2}"
    verdicts[0].correct, .extracted, .gold_extracted, .status   # status: ok | no_answer | timeout | error

Extraction is ours (fast, linear in the text): `<think>` blocks are dropped, then the last
`\\boxed{…}` / `\\fbox{…}` with balanced braces is the answer. Only that answer (never the whole
completion) goes to math-verify, which runs in worker processes of a `GradingPool`: each verdict has a
hard wall-clock limit enforced by killing the worker, so it works from any thread (math-verify's own
timeout uses SIGALRM, which only works on the main thread; we turn it off). A timeout, an exception or
a crashed worker gives `correct=False` with its status, never an exception to the caller.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

BOX_COMMANDS = ("\\boxed", "\\fbox")
MAX_ANSWER_CHARS = 100_000  # longer "answers" are not graded (status error)
MAX_COPIED_CHARS = 10_000  # `llmrl grade` copies longer completions into its output cut to this
DEFAULT_TIME_LIMIT = 5.0
WORKER_MEMORY_BYTES = 4 << 30  # address-space cap of a grading worker (sympy can explode on 10^10^10)


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None  # the model's answer (content of its last boxed), None if absent
    gold_extracted: str | None  # the gold answer that was compared
    status: str  # ok | no_answer | timeout | error
    reason: str | None = None  # why, for timeout and error


# ----------------------------------------------------------------------------- extraction (pure)


def strip_think(text: str) -> str:
    """The text without `<think>…</think>` blocks; an unclosed `<think>` hides everything after it.
    Linear: each block's end is looked for once (a regex `<think>.*?</think>` rescans the rest of the
    text from every unclosed `<think>`)."""
    kept, pos = [], 0
    while (start := text.find("<think>", pos)) >= 0 and (end := text.find("</think>", start + 7)) >= 0:
        kept.append(text[pos:start])
        pos = end + 8
    kept.append(text[pos:])
    text = "".join(kept)  # joining can make a new `<think>` (`<thi<think></think>nk>`): it hides the rest too
    cut = text.find("<think>")
    return text if cut < 0 else text[:cut]


def closing_brace(text: str, start: int) -> int | None:
    """Index of the `}` that closes the `{` at `start` (braces counted, nothing escaped), or None."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed(text: str, commands: tuple[str, ...] = BOX_COMMANDS) -> str | None:
    """Content of the last `\\boxed{…}` (or `\\fbox{…}`) with balanced braces; None if there is
    none or the last one is unclosed (the seed's rules, which fall back to an earlier box, are
    tasks/seed_parsing.py's)."""
    opens = [i + len(command) for command in commands if (i := text.rfind(command + "{")) >= 0]
    if not opens:
        return None
    start = max(opens)  # index of the opening brace
    end = closing_brace(text, start)
    return None if end is None else text[start + 1 : end]


def extract_answer(completion: str) -> str | None:
    """The model's final answer: the last boxed content outside `<think>` blocks, stripped; None if
    there is none or it is empty."""
    content = last_boxed(strip_think(completion))
    return content.strip() or None if content is not None else None


def gold_from_solution(solution: str) -> str | None:
    """The gold answer of a MATH solution: its last `\\boxed{…}`/`\\fbox{…}`."""
    content = last_boxed(solution)
    return content.strip() or None if content is not None else None


# ----------------------------------------------------------------------------- normalisation (pure)

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNITS = (
    r"(?:cm|mm|km|m|meters?|centimeters?|inch(?:es)?|in|feet|foot|ft|yards?|miles?|units?|"
    r"square|sq|cubic|degrees?|seconds?|minutes?|hours?|days?|weeks?|years?|dollars?|cents?|"
    r"pounds?|ounces?|grams?|kg|g|liters?|mph|points?|people|students?|ways?)"
)  # one spelling per word: a word two alternatives match (`inches` was) makes a failed match exponential
# A unit tail, `\text{cm}` ending the answer, has no backslash after its first, so it starts at the
# last one; the spacing before it is read backwards from there (a regex search for the whole tail
# rescans a long run of spaces from each of its characters).
_UNIT_WORDS = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*" + _UNITS + r"(?:\s+" + _UNITS + r")*\s*\}"
                         r"(?:\^\{?[23]\}?)?\s*$")
_UNIT_SPACING_REVERSED = re.compile(r"(?:\s\\|~)*\s*")  # `\s*(?:\\\s|~)*` read backwards
_DEGREE = re.compile(r"\^\s*(?:\{\s*)?\\circ\s*\}?|°|\\degree")  # one way to read a run of spaces, not `\s*\{?\s*`
_SPACES = re.compile(r"\\\\|\\[,;:! ]|\\quad|\\qquad|~")  # `\\\\` (a matrix row break) is kept
_THOUSANDS = re.compile(r"(?<=\d)(?:\\,|\\!|\{,\}|,\\!)(?=\d{3}(?!\d))")
_LOOSE_SPACE = re.compile(r"\s+(?![A-Za-z])|(?<![A-Za-z])\s+")  # spaces are kept only between letters
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?=[()\[\]|.]|\\[{}|])")
_VAR_PREFIX = re.compile(r"^\s*(?:[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+)\s*(?:=|\\in)\s*(?=\S)")
_DFRAC = re.compile(r"\\[dt]frac")


def _spacing(m: re.Match) -> str:
    token = m.group(0)
    return token if token == "\\\\" else "" if token == "\\!" else " "


def _drop_unit_tail(s: str) -> str:
    """`s` without a trailing unit word and the spacing before it: `5\\ \\text{cm}^2` -> `5`."""
    start = s.rfind("\\")
    if start < 0 or not _UNIT_WORDS.match(s, start):
        return s
    return s[: start - _UNIT_SPACING_REVERSED.match(s[:start][::-1]).end()]


def normalize(answer: str, drop_prefix: bool = True) -> str:
    """A canonical spelling of an answer for string comparison and for math-verify: no `$`, spacing
    commands, `\\left`/`\\right`, degree signs, percent signs, thousands separators, trailing unit
    words, spaces except between letters, or (with drop_prefix) `x =`/`x \\in` prefixes. MATH
    convention: none of these change the answer. Linear in the length: it runs in the trainer, outside
    the grading time limit, on answers of up to MAX_ANSWER_CHARS characters."""
    s = answer.strip().strip("$").strip()  # not a regex `\$+$`: it rescans a run of `$` from each one
    s = _THOUSANDS.sub("", s)
    s = _SPACES.sub(_spacing, s)
    s = _LEFT_RIGHT.sub("", s)
    s = _DFRAC.sub(r"\\frac", s)
    s = _DEGREE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _drop_unit_tail(s)
    if drop_prefix and (m := _VAR_PREFIX.match(s)) and "=" not in s[m.end():]:
        s = s[m.end():]  # `x = 3`, `x \\in [2,5)`; but not `x=1, y=2`
    s = _LOOSE_SPACE.sub("", s.strip())
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")  # 1,000 (but `1, 2` is a list)
    return s


def text_answer(s: str) -> tuple[str, bool] | None:
    """A plain-text answer (`\\text{Monday}`, `(C)`, `even`) as (lower-case words, was it wrapped in
    `\\text{}`), or None if it has anything but letters, spaces and punctuation."""
    inner = _TEXT_WRAPPERS.sub(lambda m: m.group(1), s).strip()
    if not re.fullmatch(r"\(?[A-Za-z][A-Za-z \-',.]*\)?", inner):
        return None
    return inner.strip("()").strip().lower(), inner != s


def same_text(a: str, b: str) -> bool | None:
    """Text answers are compared as words when both are text and one was written as `\\text{}`
    (otherwise `xy` is a product of variables); None when this rule does not apply."""
    ta, tb = text_answer(a), text_answer(b)
    if ta is None or tb is None or not (ta[1] or tb[1]):
        return None
    return ta[0] == tb[0]


# ----------------------------------------------------------------------------- math-verify (in workers)


def _mv_parse(answer: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(
        "\\boxed{" + answer + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=None,  # type: ignore[arg-type] - our worker pool enforces the time limit
    )


def judge(pred: str, gold: str) -> bool:
    """Are two extracted answers equivalent? (Runs in a grading worker: may be slow or crash.)"""
    a, b = normalize(pred), normalize(gold)
    if a == b:
        return True
    if "=" in pred + gold and _judge_math(normalize(pred, drop_prefix=False), normalize(gold, drop_prefix=False)):
        return True  # equations compared as equations: `y=2x+1` and `2x-y+1=0`
    return _judge_math(a, b)


def _judge_math(a: str, b: str) -> bool:
    """Normalised answers compared as words (text answers) or by math-verify."""
    if (words := same_text(a, b)) is not None:
        return words
    from math_verify import verify

    gold_parsed, pred_parsed = _mv_parse(b), _mv_parse(a)
    if not gold_parsed or not pred_parsed:
        return False
    if bool(verify(gold_parsed, pred_parsed, timeout_seconds=None)):  # type: ignore[arg-type]
        return True
    if "i" in a + b:  # math-verify decides per side whether `i` is the imaginary unit; make it so on both
        gold_i, pred_i = _imaginary(gold_parsed), _imaginary(pred_parsed)
        return (gold_i, pred_i) != (gold_parsed, pred_parsed) and bool(verify(gold_i, pred_i, timeout_seconds=None))  # type: ignore[arg-type]
    return False


def _imaginary(parsed: list) -> list:
    """math-verify parse results with every symbol named `i` replaced by the imaginary unit."""
    import sympy

    out = []
    for item in parsed:
        names = [sym for sym in getattr(item, "free_symbols", ()) if getattr(sym, "name", "") == "i"]
        try:
            out.append(item.subs({sym: sympy.I for sym in names}) if names else item)
        except Exception:  # noqa: BLE001 - leave what sympy cannot substitute
            out.append(item)
    return out


def parses(gold: str) -> bool:
    """Can math-verify (or the text rule) read this gold answer at all?"""
    s = normalize(gold)
    return bool(s) and (text_answer(s) is not None or bool(_mv_parse(s)))


WORKER_FUNCTIONS = {"judge": judge, "parses": parses}


PARENT_PID = "LLMRL_PARENT_PID"


def exit_with_parent(interval: float = 0.5, end: Any = None) -> None:
    """End this process when its parent goes (a SIGKILLed trainer included), even mid-job: a daemon thread
    polls the parent pid. PR_SET_PDEATHSIG would fire when the parent's creating *thread* ends, and the pool
    may be made in a rollout thread. The parent's pid comes from $LLMRL_PARENT_PID when set: a parent that died
    before this process got here is then noticed too. `end`: what to do then (default: exit at once)."""
    parent = int(os.environ.get(PARENT_PID, os.getppid()))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        (end or (lambda: os._exit(1)))()

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _worker_main() -> None:
    """A grading worker (`python -c ...`): read JSON lines [job id, function name, args] on stdin,
    write [job id, ok, result] lines on stdout."""
    import json
    import logging
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    exit_with_parent()
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    logging.disable(logging.CRITICAL)  # math-verify logs every parse failure
    import math_verify  # noqa: F401 - the imports (seconds on a busy machine) happen before "ready", so
    import sympy  # noqa: F401     they never count against a job's time limit

    sys.stdout.write(json.dumps(READY) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        job_id, name, args = json.loads(line)
        try:
            reply = [job_id, True, WORKER_FUNCTIONS[name](*args)]
        except BaseException as e:  # noqa: BLE001 - a hostile answer may break sympy in any way
            reply = [job_id, False, f"{type(e).__name__}: {e}"[:300]]
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


WORKER_COMMAND = "from llmrl.grading import _worker_main; _worker_main()"
READY = ["ready"]  # a worker's first line: imports done, jobs may be timed from now
STARTUP_LIMIT = 300.0  # seconds a worker may take to get ready (a loaded machine imports slowly)


def reap(process: subprocess.Popen) -> None:
    """Wait for a killed worker and close its pipes (the grading and environment pools' workers)."""
    process.wait(timeout=10)
    for pipe in (process.stdin, process.stdout):
        try:
            pipe.close()  # type: ignore[union-attr]
        except OSError:
            pass


class _Worker:
    """One worker process and the job it is running."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env={**os.environ, PARENT_PID: str(os.getpid())})
        self.fd = self.process.stdout.fileno()  # type: ignore[union-attr]
        self.buffer = b""
        self.job: tuple[int, float] | None = None  # (job index, start time)
        self.started = time.monotonic()
        self.ready = False  # set when its READY line arrives; no job is sent before

    def send(self, message: list) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]

    def receive(self) -> list | None:
        """The reply if a whole line has arrived; raises EOFError if the worker has died."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise EOFError
        self.buffer += chunk
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        reap(self.process)


class GradingPool:
    """Worker processes that run grading functions with a hard per-call time limit.

    `map(name, jobs)` returns one `(status, value)` per job, in order: ("ok", result), ("timeout",
    None) or ("error", message). A worker that overruns its limit is killed and replaced (its
    replacement starts in about a second). Thread-safe; usable from any thread.
    """

    def __init__(self, workers: int | None = None, time_limit: float = DEFAULT_TIME_LIMIT) -> None:
        self.n_workers = workers or max(1, min(2, os.cpu_count() or 1))
        self.time_limit = time_limit
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker()

    def map(self, name: str, jobs: list[tuple]) -> list[tuple[str, Any]]:
        """A job's time limit counts from when it is sent to a ready worker (one whose imports are
        done), so a worker starting up on a busy machine does not time out the job it is given."""
        results: list[tuple[str, Any] | None] = [None] * len(jobs)
        with self.lock:
            while len(self.workers) < self.n_workers:
                self.workers.append(_Worker())
            todo = deque(range(len(jobs)))
            while todo or any(w.job for w in self.workers):
                for w in self.workers:
                    if w.ready and w.job is None and todo:
                        i = todo.popleft()
                        try:
                            w.send([i, name, list(jobs[i])])
                            w.job = (i, time.monotonic())
                        except OSError:
                            results[i] = ("error", "grading worker unavailable")
                            self._replace(w)
                waiting = [w for w in self.workers if w.job or (not w.ready and todo)]
                if not waiting:
                    continue
                deadline = min(w.job[1] + self.time_limit if w.job else w.started + STARTUP_LIMIT for w in waiting)
                readable, _, _ = select.select([w.fd for w in waiting], [], [], max(0.0, deadline - time.monotonic()))
                for w in waiting:
                    if w.fd in readable:
                        try:
                            reply = w.receive()
                        except (EOFError, OSError, ValueError):  # died (e.g. out of memory) or garbled
                            self._fail(w, todo, results, "grading worker crashed")
                            continue
                        if reply == READY:
                            w.ready = True
                        elif reply is not None and w.job:
                            _, ok, value = reply
                            results[w.job[0]] = ("ok", value) if ok else ("error", value)
                            w.job = None
                    elif w.job and time.monotonic() - w.job[1] >= self.time_limit:
                        results[w.job[0]] = ("timeout", None)
                        self._replace(w)
                    elif not w.ready and time.monotonic() - w.started >= STARTUP_LIMIT:
                        self._fail(w, todo, results, f"grading worker not ready after {STARTUP_LIMIT:.0f} s")
        return results  # type: ignore[return-value]

    def _fail(self, w: _Worker, todo: deque, results: list, why: str) -> None:
        """A worker died or never started: its job (or, if it had none, the next queued one, so that
        a pool whose workers cannot start still ends) gets `why`; the worker is replaced."""
        i = w.job[0] if w.job else todo.popleft() if todo else None
        if i is not None:
            results[i] = ("error", why)
        self._replace(w)

    def close(self) -> None:
        with self.lock:
            for w in self.workers:
                w.kill()
            self.workers = []


_POOLS: dict[tuple[int | None, float], GradingPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(workers: int | None = None, time_limit: float = DEFAULT_TIME_LIMIT) -> GradingPool:
    """A process-wide pool per (workers, time limit), started on first use, closed at exit."""
    with _POOLS_LOCK:
        key = (workers, float(time_limit))
        if key not in _POOLS:
            _POOLS[key] = GradingPool(workers, time_limit)
        return _POOLS[key]


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


# ----------------------------------------------------------------------------- the grader


def grade_batch(items: list[tuple[str, str | None]], *, time_limit: float = DEFAULT_TIME_LIMIT,
                workers: int | None = None) -> list[Verdict]:
    """Grade (completion, gold answer) pairs. Answers that are equal after `normalize` are decided
    here; the rest go to math-verify in the worker pool. Never raises for bad input."""
    verdicts: list[Verdict | None] = [None] * len(items)
    pending: list[tuple[int, str, str]] = []
    for i, (completion, gold) in enumerate(items):
        pred = extract_answer(completion)
        if gold is None or not gold.strip():
            verdicts[i] = Verdict(False, pred, None, "error", "no gold answer")
        elif pred is None:
            verdicts[i] = Verdict(False, None, gold, "no_answer")
        elif len(pred) > MAX_ANSWER_CHARS:
            verdicts[i] = Verdict(False, pred[:200] + "…", gold, "error",
                                  f"answer of {len(pred)} characters, over the {MAX_ANSWER_CHARS} graded")
        elif normalize(pred) == normalize(gold):
            verdicts[i] = Verdict(True, pred, gold, "ok")
        else:
            pending.append((i, pred, gold))
    if pending:
        results = get_pool(workers, time_limit).map("judge", [(p, g) for _, p, g in pending])
        for (i, pred, gold), (status, value) in zip(pending, results):
            reason = {"timeout": f"math-verify took over {time_limit:g} s"}.get(status, value if status == "error" else None)
            verdicts[i] = Verdict(status == "ok" and bool(value), pred, gold, status, reason)
    return verdicts  # type: ignore[return-value]


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_GOLD_READABLE: dict[str, bool] = {}  # gold answer -> can it be read: each is read once per process
_GOLD_LOCK = threading.Lock()


def gold_readable_here(gold: str) -> bool | None:
    """`parses(gold)` where it is known without math-verify: False for an answer that normalises to nothing, True
    for a plain number or a text answer; None where math-verify must read it (in the pool)."""
    s = normalize(gold)
    if not s:
        return False
    return True if _PLAIN_NUMBER.fullmatch(s) or text_answer(s) is not None else None


def gold_parses(golds: list[str], *, time_limit: float = DEFAULT_TIME_LIMIT, workers: int | None = None) -> list[bool]:
    """Whether each gold answer can be read (by math-verify or as a text answer). Each distinct answer is read once per
    process (the verdicts are kept, by the answer's text); plain numbers and text answers without the pool."""
    with _GOLD_LOCK:
        todo = list(dict.fromkeys(g for g in golds if g not in _GOLD_READABLE))
        for g in todo:
            if (here := gold_readable_here(g)) is not None:
                _GOLD_READABLE[g] = here
        todo = [g for g in todo if g not in _GOLD_READABLE]
    if todo:
        results = get_pool(workers, time_limit).map("parses", [(g,) for g in todo])
        with _GOLD_LOCK:
            for g, (status, value) in zip(todo, results):
                _GOLD_READABLE[g] = status == "ok" and bool(value)
    return [_GOLD_READABLE[g] for g in golds]


def draw_readable(rows: list, n: int, rng: Any, gold: Any, *, what: str, time_limit: float = DEFAULT_TIME_LIMIT,
                  workers: int | None = None) -> list:
    """`n` rows drawn at random from `rows` (`rng.randrange`), each with a gold answer (`gold(row)`) that can be read:
    golds are read when their row is drawn (`gold_parses`), and a row whose gold cannot be read is drawn again. With
    every gold readable these are exactly the rows `rows[rng.randrange(len(rows))]` drawn n times; otherwise a
    uniform draw from the readable rows, as when the others were dropped at start (which read every gold of the
    pool: 10^4 rows took 38 s). One DataError line (`what`: the data) when no gold can be read."""
    picked: list = [None] * n
    todo = list(range(n))
    while todo:
        drawn = [(slot, rows[rng.randrange(len(rows))]) for slot in todo]
        readable = gold_parses([gold(row) for _, row in drawn], time_limit=time_limit, workers=workers)
        todo = []
        for (slot, row), ok in zip(drawn, readable):
            if ok:
                picked[slot] = row
            else:
                todo.append(slot)
        if todo and all(_GOLD_READABLE.get(gold(row)) is False for row in rows):
            from llmrl.errors import DataError

            raise DataError(f"{what}: math-verify can read none of the {len(rows)} gold answers")
    return picked


def first_readable(rows: list, n: int, gold: Any, *, time_limit: float = DEFAULT_TIME_LIMIT,
                   workers: int | None = None) -> list:
    """The first `n` rows of `rows` whose gold answer (`gold(row)`) can be read: golds are read in order, only as many
    as needed (the rows an eval of `n` takes from a pool whose unreadable golds were dropped)."""
    kept: list = []
    i = 0
    while len(kept) < n and i < len(rows):
        chunk = rows[i : i + n - len(kept)]
        i += len(chunk)
        readable = gold_parses([gold(row) for row in chunk], time_limit=time_limit, workers=workers)
        kept += [row for row, ok in zip(chunk, readable) if ok]
    return kept


# ----------------------------------------------------------------------------- `llmrl grade`


def read_grade_input(line: str) -> tuple[str, str | None] | str:
    """(completion, gold answer) from one input line, or the reason the line cannot be graded."""
    try:
        row = json.loads(line)
    except ValueError:
        return "not valid JSON"
    if not isinstance(row, dict) or not isinstance(row.get("completion"), str):
        return "needs a text field `completion`"
    if isinstance(row.get("gold"), (str, int, float)) and not isinstance(row.get("gold"), bool):
        return row["completion"], str(row["gold"])
    if isinstance(row.get("solution"), str):
        return row["completion"], gold_from_solution(row["solution"])
    return "needs `gold` (an answer) or `solution` (a MATH solution)"


def grade_file(src: str, dst: str, *, time_limit: float = DEFAULT_TIME_LIMIT, workers: int | None = None,
               chunk: int = 1024) -> dict[str, Any]:
    """Grade a JSONL file line by line into `dst` (same order, each input object plus `correct`,
    `extracted`, `gold_extracted`, `status`); returns the summary counts."""
    counts = {"ok": 0, "no_answer": 0, "timeout": 0, "error": 0, "correct": 0}
    t0 = time.perf_counter()
    n = 0
    with open(src, "rb") as fin, open(dst + ".tmp", "w", encoding="utf-8") as fout:
        lines = (raw.decode("utf-8", errors="replace").replace("\x00", "") for raw in fin if raw.strip())
        while batch := [line for _, line in zip(range(chunk), lines)]:
            parsed = [read_grade_input(line) for line in batch]
            todo = [p for p in parsed if isinstance(p, tuple)]
            verdicts = iter(grade_batch(todo, time_limit=time_limit, workers=workers))  # type: ignore[arg-type]
            for line, p in zip(batch, parsed):
                if isinstance(p, str):
                    out: dict[str, Any] = {"line": n + 1, "correct": False, "extracted": None, "gold_extracted": None,
                                           "status": "error", "error": p}
                    counts["error"] += 1
                else:
                    v = next(verdicts)
                    row = json.loads(line)
                    if len(row["completion"]) > MAX_COPIED_CHARS:  # the output keeps a head, not 200 KB per line
                        row["completion"], row["completion_chars"] = row["completion"][:MAX_COPIED_CHARS] + "…", len(row["completion"])
                    out = {**row, "correct": v.correct, "extracted": v.extracted, "gold_extracted": v.gold_extracted,
                           "status": v.status, **({"reason": v.reason} if v.reason else {})}
                    counts[v.status] += 1
                    counts["correct"] += v.correct
                fout.write(json.dumps(out) + "\n")
                n += 1
    os.replace(dst + ".tmp", dst)
    seconds = time.perf_counter() - t0
    return {"graded": n, **counts, "seconds": round(seconds, 3), "per_second": round(n / seconds, 1) if seconds else None}
