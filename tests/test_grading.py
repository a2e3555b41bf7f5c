"""The math grader: extraction, normalisation, math-verify verdicts on a hand-written fixture, hostile
inputs under a hard time limit, grading off the main thread, `llmrl grade`, and math_hard's verify mode."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import cli, read_jsonl, run_cli, tiny_args
from llmrl.grading import (
    MAX_ANSWER_CHARS, GradingPool, extract_answer, gold_from_solution, grade_batch, last_boxed, normalize, same_text,
    strip_think,
)
from llmrl.tasks.math_hard import MathHardTask

FIXTURES = Path(__file__).parent / "fixtures"
CASES = [json.loads(line) for line in (FIXTURES / "grading_cases.jsonl").read_text().splitlines() if line.strip()]
LIMIT = 2.0  # seconds per verdict in these tests (the default is 5)


def test_extraction():
    assert last_boxed("a \\boxed{1} b \\fbox{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} then \\boxed{2") is None  # the last one is unclosed
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\fbox{3}", commands=("\\boxed",)) is None
    assert strip_think("<think>\\boxed{1}</think> so \\boxed{2}") == " so \\boxed{2}"
    assert extract_answer("<think>\\boxed{1}</think> no answer") is None
    assert extract_answer("<think>a</think>\\boxed{ 7 }<think>\\boxed{8}") == "7"  # unclosed think hides the rest
    assert extract_answer("\\boxed{}") is None
    assert gold_from_solution("so $x=\\boxed{\\dfrac{3}{4}}$.") == "\\dfrac{3}{4}"


@pytest.mark.parametrize("raw, canon", [
    ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("10\\%", "10"),
    ("x = 3", "3"), ("x\\in[2,5)", "[2,5)"), ("\\left( 1, 2 \\right)", "(1,2)"),
    ("1{,}000", "1000"), ("10,\\!000", "10000"), ("5\\text{ cm}", "5"), ("12\\mbox{ inches}^2", "12"),
    ("1, 2", "1,2"), ("1,000", "1000"),  # a list is not a number with thousands separators
])
def test_normalize(raw, canon):
    assert normalize(raw) == canon


@pytest.mark.parametrize("raw, drop_prefix, canon", [  # the outputs of the former regex-only normalize
    (" $x = \\dfrac{3}{4}$ ", True, "\\frac{3}{4}"), ("10\\ \\text{cm}^2", True, "10"),
    ("5~\\mbox{ inches }", True, "5"), ("3\\text{ square units}", True, "3"), ("1,\\!000,\\!000", True, "1000000"),
    ("\\left[ 2, 5 \\right)", True, "[2,5)"), ("45^{\\circ}", True, "45"), ("90°", True, "90"),
    ("12.5\\%", True, "12.5"),
    ("y = 2x + 1", True, "2x+1"), ("y = 2x + 1", False, "y=2x+1"), ("x=1, y=2", True, "x=1,y=2"),
    ("a \\in \\{1, 2\\}", True, "\\{1,2\\}"), ("\\text{Monday}", True, "\\text{Monday}"), ("(C)", True, "(C)"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True, "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\sqrt{2} \\, \\text{m}", True, "\\sqrt{2}"), ("\\tfrac12 \\quad \\text{ways}", True, "\\frac12"),
    ("4 \\text{ hours and } 5", True, "4\\text{hours and}5"), ("5\\text{ cm} + 2", True, "5\\text{cm}+2"),  # not a tail
    ("6\\ \\text{ft} \\; 3\\ \\text{in}", True, "6\\text{ft}3"), ("2 \\text{inches inches}", True, "2"),
    ("\\text{ meters}^{3}", True, ""), ("  -3,456.78 ", True, "-3456.78"), ("$$\\$1,000$$", True, "\\$1,000"),
])
def test_normalize_keeps_its_results(raw, drop_prefix, canon):
    assert normalize(raw, drop_prefix) == canon


@pytest.mark.parametrize("text, kept", [  # the outputs of the former regex strip_think
    ("<think>a</think>b<think>c</think>d", "bd"), ("x<think>1</think>y<think>2", "xy"),
    ("<think><think>a</think>b</think>c", "b</think>c"), ("</think>a<think>b", "</think>a"),
    ("<thi<think></think>nk>z", ""),  # removing a block joins a new `<think>`, unclosed
    ("<think>\n\\boxed{1}\n</think>\n\\boxed{2}", "\n\\boxed{2}"), ("no think", "no think"),
])
def test_strip_think_keeps_its_results(text, kept):
    assert strip_think(text) == kept


HOSTILE_FAMILIES = {  # n characters of text that made the regex normaliser quadratic (or worse), and its neighbours
    "spaces": (normalize, lambda n: "1" + " " * n + "1"),
    "tildes": (normalize, lambda n: "1" + "~" * n + "1"),
    "spacing commands": (normalize, lambda n: "1" + "\\," * (n // 2) + "1"),
    "dollars": (normalize, lambda n: "1" + "$" * n + "1"),
    "caret then spaces": (normalize, lambda n: "^" + " " * n + "x"),
    "unit words": (normalize, lambda n: "5\\text{" + "inches " * (n // 7) + "x}"),
    "fractions": (normalize, lambda n: "\\frac{" * (n // 6)),
    "nested braces": (normalize, lambda n: "{" * (n // 2) + "}" * (n // 2)),
    "digits": (normalize, lambda n: "1" * n),
    "unclosed thinks": (strip_think, lambda n: "<think>a" * (n // 8)),
    "boxes": (extract_answer, lambda n: "\\boxed{" * (n // 7)),
}


def _cpu_seconds(f, text: str) -> float:
    best = float("inf")
    for _ in range(3):  # the fastest of three: another process sharing the core only adds time
        t0 = time.process_time()
        f(text)
        best = min(best, time.process_time() - t0)
    return best


@pytest.mark.parametrize("family", HOSTILE_FAMILIES)
def test_normalisation_is_linear(family):
    """10x the text takes at most 40x the CPU time (linear: about 10x; the regexes took 100x or never
    ended). A ratio, not a time: the machine may be slow or shared."""
    f, make = HOSTILE_FAMILIES[family]
    small, large = _cpu_seconds(f, make(MAX_ANSWER_CHARS // 10)), _cpu_seconds(f, make(MAX_ANSWER_CHARS))
    assert large <= 40 * max(small, 1e-4), (family, small, large)  # 0.1 ms: below it a ratio is noise


def test_hostile_answers_of_the_largest_graded_size_get_verdicts(tmp_path):
    """`llmrl grade` on answers of MAX_ANSWER_CHARS built to be slow to normalise: each gets its verdict
    (the work outside the workers is linear, math-verify's is cut at the time limit). The process
    timeout is generous; the former normaliser took minutes on the first and never ended on `unit words`."""
    n = MAX_ANSWER_CHARS - 20
    rows = {
        "spaces": ("\\boxed{1" + " " * n + "1}", "11", True),
        "tildes": ("\\boxed{1" + "~" * n + "1}", "11", True),
        "caret then spaces": ("\\boxed{2^" + " " * n + "3}", "8", None),
        "unit words": ("\\boxed{5\\text{" + "inches " * (n // 7) + "x}}", "5", None),
        "dollars": ("\\boxed{1" + "$" * n + "1}", "1", None),
        "unclosed thinks": ("\\boxed{7}" + "<think>" * (n // 7), "7", True),
        "nested fractions": ("\\boxed{" + "\\frac{1}{" * (n // 10) + "2" + "}" * (n // 10) + "}", "1", False),
        "nested braces": ("\\boxed{" + "{" * (n // 2) + "1" + "}" * (n // 2) + "}", "1", None),
        "digits": ("\\boxed{" + "1" * n + "}", "1", False),
        "unclosed boxes": ("\\boxed{" * (n // 7), "1", False),
    }
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"completion": c, "gold": g}) + "\n" for c, g, _ in rows.values()))
    p = subprocess.run([sys.executable, "-m", "llmrl", "grade", "--input", str(src), "--output", str(dst),
                        "--time_limit", str(LIMIT)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for (name, (_, _, expected)), out in zip(rows.items(), read_jsonl(dst), strict=True):
        assert out["status"] in ("ok", "no_answer", "timeout", "error"), name  # error: sympy may crash (recursion)
        assert "graded" not in out.get("reason", ""), (name, out["reason"])  # not refused as too long
        if expected is not None:
            assert out["correct"] is expected, (name, out["status"], out.get("reason"))


def test_text_answers_compare_as_words():
    assert same_text("\\text{Monday}", "monday") is True
    assert same_text("\\text{(C)}", "C") is True
    assert same_text("\\text{even}", "\\text{odd}") is False
    assert same_text("xy", "yx") is None  # not text: math-verify decides (a product)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fixture_verdicts(case):
    if case.get("known_limitation"):
        pytest.xfail(case["known_limitation"])  # stays listed; see the fixture line
    [v] = grade_batch([(case["completion"], case["gold"])], time_limit=LIMIT)
    if v.status == "timeout":  # a busy machine (CI beside other work) can slow sympy past LIMIT: the verdict is
        [v] = grade_batch([(case["completion"], case["gold"])], time_limit=30.0)  # what is tested, not the speed
    assert v.status in ("ok", "no_answer"), v
    assert v.correct is case["expected"], f"{case['why']}: {v}"


def test_fixture_is_broad():
    types = {c["type"] for c in CASES}
    assert len(CASES) >= 150 and len(types) >= 15
    assert sum(c["expected"] for c in CASES) >= 50 and sum(not c["expected"] for c in CASES) >= 50


HOSTILE = {
    "1 MB completion": ("word " * 200_000 + "\\boxed{7}", "7", True),
    "10,000 nested braces": ("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1", None),
    "unclosed boxed": ("the answer is \\boxed{12", "12", False),
    "power tower": ("\\boxed{10^{10^{10^{10}}}}", "5", False),
    "5,000-term sum": ("\\boxed{" + "+".join(["1"] * 5000) + "}", "5000", None),
    "invalid LaTeX": ("\\boxed{\\frac{1}{}}}\\sqrt[}{", "2", False),
    "NUL bytes": ("\\boxed{3\x00}\x00", "3", None),
    "lone surrogate": ("\\boxed{4\udcff}", "4", None),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_inputs_return_within_the_limit(name):
    completion, gold, expected = HOSTILE[name]
    t0 = time.monotonic()
    [v] = grade_batch([(completion, gold)], time_limit=LIMIT)
    assert time.monotonic() - t0 < LIMIT + 1.5, name
    assert v.status in ("ok", "no_answer", "timeout", "error")
    if expected is not None:
        assert v.correct is expected, v


def test_timeout_kills_the_worker_and_the_pool_goes_on():
    """The hard job times out and its worker is replaced; the easy one, sent to the replacement, is
    timed from when that worker is ready (its imports can take longer than the limit on a busy machine)."""
    pool = GradingPool(workers=1, time_limit=1.0)
    try:
        out = pool.map("judge", [("10^{10^{10^{10}}}", "5"), ("0.5", "\\frac{1}{2}")])
        assert out[0] == ("timeout", None) and out[1] == ("ok", True)
    finally:
        pool.close()


def test_a_slow_starting_worker_does_not_time_out_its_job(monkeypatch):
    """A worker that takes 2.5 s to start (a loaded machine importing sympy) gets its jobs only when
    ready: a 1 s limit applies to the job, not to the start-up."""
    import llmrl.grading as grading

    monkeypatch.setattr(grading, "WORKER_COMMAND", "import time; time.sleep(2.5); " + grading.WORKER_COMMAND)
    pool = GradingPool(workers=1, time_limit=1.0)
    try:
        assert pool.map("judge", [("0.5", "\\frac{1}{2}"), ("2", "3")]) == [("ok", True), ("ok", False)]
    finally:
        pool.close()


def test_a_worker_that_cannot_start_fails_its_jobs_and_the_pool_ends(monkeypatch):
    import llmrl.grading as grading

    monkeypatch.setattr(grading, "WORKER_COMMAND", "raise SystemExit(3)")
    pool = GradingPool(workers=1, time_limit=1.0)
    try:
        assert pool.map("judge", [("1", "1"), ("2", "2")]) == [("error", "grading worker crashed")] * 2
    finally:
        pool.close()


def test_grading_from_a_worker_thread():
    """math-verify's own timeout (SIGALRM) fails off the main thread; ours does not."""
    results = []
    thread = threading.Thread(target=lambda: results.append(grade_batch(
        [("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt2}"), ("\\boxed{10^{10^{10^{10}}}}", "5")], time_limit=LIMIT)))
    thread.start()
    thread.join(timeout=30)
    [[ok, slow]] = results
    assert ok.correct and ok.status == "ok"
    assert not slow.correct and slow.status in ("timeout", "error", "ok")


def test_grade_command(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [
        {"completion": "so \\boxed{0.5}", "gold": "\\frac12"},
        {"completion": "no box", "solution": "Hence $\\boxed{3}$."},
        {"completion": "\\boxed{(1,2)}", "gold": "(2,1)"},
        {"completion": "\\boxed{2}", "gold": 2},
    ]
    with open(src, "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows[:2]))
        f.write(b"{not json\xff\x00}\n")
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows[2:]))
    p = cli("grade", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--time_limit", str(LIMIT))
    assert "5 graded, 2 correct" in p.stdout and "completions/s" in p.stdout
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [(r["correct"], r["status"]) for r in out] == [
        (True, "ok"), (False, "no_answer"), (False, "error"), (False, "ok"), (True, "ok")]
    assert out[0]["extracted"] == "0.5" and out[1]["gold_extracted"] == "3" and out[0]["completion"] == rows[0]["completion"]
    missing = run_cli("grade", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o.jsonl"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nope.jsonl" in missing.stderr


def test_math_hard_verify_keeps_every_readable_answer():
    seed = MathHardTask(data=str(FIXTURES / "math_tiny.jsonl"))
    verify = MathHardTask(data=str(FIXTURES / "math_tiny.jsonl"), reward="verify", time_limit=LIMIT)
    assert len(verify.train_rows) == len(seed.train_rows) + 2  # the \sqrt and 10,\!000 answers the seed drops
    assert "non-numeric answer" in seed.data_report["train"]["dropped"]
    assert "non-numeric answer" not in verify.data_report["train"]["dropped"]
    ex = verify.example({"problem": "p", "gold": "\\frac{\\sqrt{3}}{2}", "gold_text": "\\frac{\\sqrt{3}}{2}"})
    rewards = verify.reward_batch([ex] * 4, ["\\boxed{\\sqrt3/2}", "\\boxed{0.5}", "it is \\sqrt3/2", "\\boxed{10^{10^{10^{10}}}}"])
    assert [r.total for r in rewards] == pytest.approx([1.1, 0.1, 0.0, 0.1])
    assert rewards[3].counts["grade_timeouts"] == 1
    m = verify.evaluate([ex] * 2, ["\\boxed{\\frac{\\sqrt3}{2}}", "\\boxed{1}"])
    assert m["correct"] == 0.5 and m["boxed_rate"] == 1.0


def test_training_step_with_math_verify(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cli(*tiny_args(str(tiny_model_dir), out, "grpo", steps=1, task="math_hard", math_data=str(FIXTURES / "math_tiny.jsonl"),
                   math_reward="verify", max_prompt_tokens=160, grade_time_limit=LIMIT))
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 1 and {"reward/boxed", "reward/correct", "reward/grade_timeouts"} <= set(train[0])
    assert "eval/correct" in records[-1]
    assert json.loads((out / "data_report.json").read_text())["reward"] == "verify"


def test_grade_gives_a_reason_and_cuts_huge_completions(tmp_path):
    from llmrl.grading import MAX_ANSWER_CHARS, MAX_COPIED_CHARS

    huge = "\\boxed{" + "1" * 200_000 + "}"
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (
        {"completion": huge, "gold": "1"}, {"completion": "\\boxed{2}", "gold": ""}, {"completion": "\\boxed{3}", "gold": "3"},
    )) + "\n")
    cli("grade", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--time_limit", str(LIMIT))
    big, nogold, fine = read_jsonl(tmp_path / "out.jsonl")
    assert big["status"] == "error" and big["reason"] == f"answer of 200000 characters, over the {MAX_ANSWER_CHARS} graded"
    assert len(big["completion"]) == MAX_COPIED_CHARS + 1 and big["completion_chars"] == len(huge)
    assert nogold["status"] == "error" and nogold["reason"] == "no gold answer"
    assert fine["status"] == "ok" and "reason" not in fine and fine["completion"] == "\\boxed{3}"


def test_a_grading_worker_dies_with_its_trainer(tmp_path):
    """SIGKILL the process that started a worker (before the worker has even imported llmrl) while the worker's
    stdin stays open (here, held by the test), so only the worker's parent watch can end it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from llmrl.grading import PARENT_PID, WORKER_COMMAND

    r, w = os.pipe()
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
         f"p = subprocess.Popen([sys.executable, '-c', {WORKER_COMMAND!r}], stdin={r}, stdout=subprocess.DEVNULL,\n"
         f"                     env={{**os.environ, {PARENT_PID!r}: str(os.getpid())}})\n"
         "print(p.pid, flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, pass_fds=(r,))
    os.close(r)
    worker = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60  # the worker's imports may still be running on a loaded machine
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{worker}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":  # exited; a container's init may not reap it
                    break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.2)
    else:
        os.kill(worker, signal.SIGKILL)
        raise AssertionError(f"grading worker {worker} outlived its SIGKILLed parent")
    os.close(w)
