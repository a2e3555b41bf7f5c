"""Write small.jsonl: 240 one- and two-step arithmetic word problems in GSM8K's format (a worked answer
ending in `#### N`), for CPU runs of `--dataset` on the embedded model. Deterministic (seed 0):

    python examples/gsm8k/make_small.py
"""

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
THINGS = ["apples", "books", "coins", "pencils", "stamps", "shells", "cards", "marbles"]


def problem(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "mul", "two"])
    if kind == "add":
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        work, n = f"{name} has {a} + {b} = {a + b} {thing}.", a + b
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
        work, n = f"{a} - {b} = {a - b} {thing} are left.", a - b
    elif kind == "mul":
        b = rng.randint(2, 9)
        q = f"{name} buys {b} boxes with {a} {thing} in each. How many {thing} is that?"
        work, n = f"{b} boxes of {a} is {b} * {a} = {b * a} {thing}.", a * b
    else:
        q = f"{name} has {a} {thing}, finds {b} more, then doubles them. How many {thing} does {name} have?"
        work, n = f"First {a} + {b} = {a + b}. Doubled: {a + b} * 2 = {2 * (a + b)}.", 2 * (a + b)
    return {"question": q, "answer": f"{work}\n#### {n}"}


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("small.jsonl")
    out.write_text("".join(json.dumps(problem(rng)) + "\n" for _ in range(240)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
