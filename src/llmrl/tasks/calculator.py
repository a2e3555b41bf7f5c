"""calculator: 3-digit × 2-digit products, which the 135M model cannot do in its head, with a `calc` tool.

An episode: the question (after one worked exchange in the chat history); the policy may write
<calc>EXPRESSION</calc>, or a reply that is only an arithmetic expression (the environment answers
<result>VALUE</result>), and ends with <answer>NUMBER</answer>. Reward: 1.0 for the right product in
the answer tag ("correct"), 0.1 for a calculator call whose result is that product ("tool"); max 1.1.
No credit for an answer alone (the model guesses products in its head, always wrong: a format credit
for that made it stop calling the tool), nor for calls on other numbers (a credit for any valid call
taught it to call "74 * 10" and stop; both measured on the embedded model).
"""

from __future__ import annotations

import ast
import operator
import random
import re

from llmrl.tasks.base import Example, Reward, SeededSampling
from llmrl.tasks.env import Environment, Episode, Turn, call_tool, find_tool_call

SYSTEM = ("You cannot multiply in your head. First write <calc>A*B</calc> to use the calculator; it answers "
          "<result>N</result>. Then write <answer>N</answer>.")
USER = "Multiply {a} * {b}"
SHOTS = [  # one worked exchange in the chat history: the protocol, with other numbers
    {"role": "user", "content": "Multiply 12 * 34"},
    {"role": "assistant", "content": "<calc>12*34</calc>"},
    {"role": "user", "content": "<result>408</result>"},
    {"role": "assistant", "content": "<answer>408</answer>"},
]
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
BARE = re.compile(r"[\d\s().]*\d\s*[-+*/x×]\s*[\d\s().+*/x×-]*")  # e.g. "964*59": arithmetic and nothing else
WEIGHTS = {"correct": 1.0, "tool": 0.1}
EVAL_SEED_OFFSET = 321
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
       ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def arithmetic(expression: str) -> int | float:
    """The value of + - * / // and parentheses over numbers (no names, no calls, no powers)."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {expression[:40]!r}")

    if len(expression) > 100:
        raise ValueError("expression too long")
    result = value(ast.parse(expression.replace("×", "*").replace("x", "*"), mode="eval").body)
    return int(result) if float(result).is_integer() else round(result, 6)


class CalculatorEnv(SeededSampling, Environment):
    name = "calculator"
    eval_n_default = 32
    max_turns = 3
    tools = {"calc": arithmetic}

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.eval_seed = seed + EVAL_SEED_OFFSET

    @staticmethod
    def example(a: int, b: int) -> Example:
        return Example(messages=[{"role": "system", "content": SYSTEM}, *SHOTS, {"role": "user", "content": USER.format(a=a, b=b)}],
                       answer=a * b, meta={"a": a, "b": b})

    def _draw(self, rng: random.Random, n: int) -> list[Example]:
        return [self.example(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(n)]

    def sample_train_batch(self, n: int) -> list[Example]:
        return self._draw(self.rng, n)

    def eval_examples(self, n: int) -> list[Example]:
        return self._draw(random.Random(self.eval_seed), n)

    def step(self, episode: Episode, reply: str) -> Turn:
        m = ANSWER.search(reply)
        if m:
            episode.state = int(m.group(1))  # the final answer
            return Turn(None)
        call = find_tool_call(reply, self.tools)
        if call is None and BARE.fullmatch(reply.strip()):  # a reply that is only an expression is a call too
            call = ("calc", reply.strip())
        if call is None:
            return Turn(None)  # neither a calculation nor an answer: the episode ends without one
        result, ok = call_tool(self.tools, *call)
        right = float(ok and result == str(episode.example.answer))  # the question's product, not any sum
        return Turn([{"role": "user", "content": f"<result>{result}</result>"}], parts={"right_call": right},
                    tool_calls=1, tool_errors=int(not ok))

    def reward(self, episode: Episode) -> Reward:
        answer = episode.state
        flags = {"correct": answer == episode.example.answer, "tool": episode.parts.get("right_call", 0.0) > 0}
        components = {k: WEIGHTS[k] * float(v) for k, v in flags.items()}
        return Reward(total=sum(components.values()), components=components)

    def correct(self, episode: Episode) -> bool:
        return episode.state == episode.example.answer

    def evaluate(self, episodes: list[Episode]) -> dict[str, float]:
        n = max(len(episodes), 1)
        return {"correct": sum(ep.state == ep.example.answer for ep in episodes) / n,
                "answered": sum(ep.state is not None for ep in episodes) / n,
                "used_calc": sum(ep.tool_calls > 0 for ep in episodes) / n,
                "turns": sum(ep.replies for ep in episodes) / n}
