"""The shape of the house: no import circle between llmrl's modules, and a step path that stays short."""

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"
# the step path: one RL step from drawing prompts to the metrics record (algorithms, engines, episodes, scoring
# and the data containers are the components it calls, each its own module)
STEP_PATH = ("llmrl/training/step.py", "llmrl/training/rollouts.py", "llmrl/training/update.py")


def module_imports() -> dict[str, set[str]]:
    """Every llmrl module → the llmrl modules it imports at module level (imports inside functions are lazy:
    they cannot make a circle at import time). `from pkg import sub` depends on pkg.sub, not on pkg."""
    modules = {}
    for path in (SRC / "llmrl").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmrl"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("llmrl")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circles_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_between_llmrl_modules():
    graph = module_imports()
    assert "llmrl.training.step" in graph and "llmrl.training.rollouts" in graph["llmrl.training.step"]
    assert circles(graph) == []


def test_the_step_path_has_at_most_25_functions():
    names = []
    for rel in STEP_PATH:
        tree = ast.parse((SRC / rel).read_text())
        names += [f"{rel}:{n.name}" for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(names) <= 25, "\n".join(names)
