"""Grade held-out competition-math problems with their own reference solutions as completions (should be
correct) and with the solution of a different problem (should be wrong), and time `llmrl grade`.

    python benchmarks/heldout_grading.py PROBLEMS.jsonl      # lines with `problem` and `solution`

The data is not shipped: any MATH-style JSONL whose solutions end in \\boxed{...} works.
"""

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8") if line.strip()]
order = list(range(len(rows)))
random.Random(0).shuffle(order)
other = {order[i]: order[(i + 1) % len(order)] for i in range(len(order))}  # a derangement
with tempfile.TemporaryDirectory() as tmp:
    src, dst = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
    with open(src, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"kind": "own", "completion": r["solution"], "solution": r["solution"]}) + "\n")
            f.write(json.dumps({"kind": "swapped", "completion": rows[other[i]]["solution"], "solution": r["solution"]}) + "\n")
    p = subprocess.run([sys.executable, "-m", "llmrl", "grade", "--input", str(src), "--output", str(dst)],
                       capture_output=True, text=True, check=True)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
own = [o for o in out if o["kind"] == "own"]
swapped = [o for o in out if o["kind"] == "swapped"]
print(p.stdout.strip())
print(f"own solution graded correct: {sum(o['correct'] for o in own)}/{len(own)} "
      f"({100 * sum(o['correct'] for o in own) / len(own):.2f}%)")
print(f"other problem's solution graded correct: {sum(o['correct'] for o in swapped)}/{len(swapped)} "
      f"({100 * sum(o['correct'] for o in swapped) / len(swapped):.2f}%)")
from llmrl.grading import normalize  # noqa: E402

distinct = [o for o in swapped if normalize(o["extracted"] or "") != normalize(o["gold_extracted"] or "")]
print(f"  of those, pairs whose answers differ as written (after normalize): {sum(o['correct'] for o in distinct)}/"
      f"{len(distinct)} graded correct")
for o in own:
    if not o["correct"]:
        print("  missed:", o["status"], repr(o["extracted"]), "vs", repr(o["gold_extracted"]))
for o in swapped:
    if o["correct"]:
        print("  accepted:", repr(o["extracted"]), "vs", repr(o["gold_extracted"]))
