"""The common mistakes of a user's second hour, replayed through the real CLI: each must end in one `llmrl:` line
naming the fix, with no traceback. `python tests/mistakes.py` prints the table (a markdown table for notes);
tests/test_mistakes.py runs the same cases.

Each case runs `llmrl ARGS` in a fresh directory holding FILES; OK when stderr has no traceback, exactly one
line starting `llmrl: error:` or `llmrl: warning:` and that line contains every one of FIX's strings. A warning
case is a run that goes on after its line: it is stopped there. The --nproc case needs a machine without a GPU and
with fewer than 3 cores (tests/test_mistakes.py skips it elsewhere).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

EMBEDDED = "smollm2-135m-instruct"
GSM_ROWS = "".join(f'{{"question": "Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": "{a + b}"}}\n'
                   for a, b in zip(range(3, 33), range(40, 10, -1)))  # 30 rows, as the user's own file had


@dataclass
class Mistake:
    what: str  # the mistake, as a user makes it
    args: list[str]  # after `llmrl`
    fix: tuple[str, ...]  # what the one line must name
    files: dict[str, str] = field(default_factory=dict)
    warning: bool = False  # the run goes on after its one line (stopped once the line is out)


MISTAKES = [
    Mistake("reward function with a wrong signature", ["train", "--model", EMBEDDED, "--dataset", "rows.jsonl",
            "--reward_funcs", "rewards.py:correct", "--steps", "1"], ("correct", "(prompts, completions"),
            {"rows.jsonl": GSM_ROWS, "rewards.py": "def correct(completion, answer):\n    return 1.0\n"}),
    Mistake("--nproc 3 on a 2-core CPU machine", ["train", "--nproc", "3", "--model", EMBEDDED, "--steps", "1",
            "--batch_size", "6", "--group_size", "4", "--output_dir", "runs/x"], ("--nproc 2 or fewer",), warning=True),
    Mistake("an extra that is not installed", ["train", "--model", EMBEDDED, "--task", "verifiers:word_sums"],
            ('pip install -e ".[verifiers]"',)),
    Mistake("TRL's flag name", ["train", "--learning-rate", "1e-5"], ("--lr",)),
    Mistake("a YAML syntax error", ["train", "--config", "run.yaml"], ("line 3, column",),
            {"run.yaml": "model: smollm2-135m-instruct\nsteps: 2\n  lr: 1e-5\n"}),
    Mistake("a misspelt reasoning-gym dataset", ["train", "--model", EMBEDDED, "--task", "reasoning_gym:chain_summ"],
            ("chain_sum",)),
    Mistake("a misspelt task", ["train", "--model", EMBEDDED, "--task", "format_copyy"], ("did you mean format_copy",)),
    Mistake("a data file that is not there", ["train", "--model", EMBEDDED, "--dataset", "row.jsonl"],
            ("row.jsonl", "no such file")),
    Mistake("a dataset without an answer column", ["train", "--model", EMBEDDED, "--dataset", "rows.jsonl"],
            ("--answer_field",), {"rows.jsonl": '{"prompt": "What is 2+2?"}\n{"prompt": "What is 3+3?"}\n'}),
    Mistake("fewer training rows than one batch", ["train", "--model", EMBEDDED, "--dataset", "rows.jsonl",
            "--batch_size", "8", "--eval_holdout", "1"], ("--batch_size",), {"rows.jsonl": GSM_ROWS[:GSM_ROWS.index("\n", 300)]}),
    Mistake("--resume of a directory that is not a run", ["train", "--resume", "runs/nothing"], ("not a run directory",)),
]


def replay(m: Mistake, llmrl: list[str] | None = None, timeout: float = 180) -> tuple[bool, str]:
    """(ok, the llmrl lines or what went wrong) for one mistake, run in a temporary directory."""
    with tempfile.TemporaryDirectory() as d:
        for name, text in m.files.items():
            Path(d, name).write_text(text)
        cmd = (llmrl or [sys.executable, "-m", "llmrl"]) + m.args
        p = subprocess.Popen(cmd, cwd=d, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                             env={**os.environ, "TQDM_DISABLE": "1"}, start_new_session=True)
        try:
            if m.warning:  # the first llmrl line, then the run is stopped
                err = ""
                for line in p.stderr:
                    err += line
                    if line.startswith("llmrl: warning:"):
                        break
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            else:
                _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"still running after {timeout:.0f} s"
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    lines = [line for line in err.splitlines() if line.startswith(("llmrl: error:", "llmrl: warning:"))]
    if "Traceback" in err:
        return False, "traceback: " + err[-300:]
    if len(lines) != 1:
        return False, f"{len(lines)} llmrl lines: {lines or err[-300:]}"
    return all(f in lines[0] for f in m.fix), lines[0]


def main() -> int:
    results = [(m, *replay(m)) for m in MISTAKES]
    print("| mistake | command | one line naming the fix | what llmrl says |\n|---|---|---|---|")
    for m, ok, line in results:
        print(f"| {m.what} | `llmrl {' '.join(m.args)}` | {'yes' if ok else 'NO'} | {line.replace('|', '/')} |")
    passed = sum(ok for _, ok, _ in results)
    print(f"\n{passed} of {len(results)} mistakes get one line naming the fix")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
