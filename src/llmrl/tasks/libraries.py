"""Tasks from environment libraries, named `--task LIBRARY:NAME` (each library an optional extra that leaves
llmrl's torch and transformers as they are).

    --task reasoning_gym:chain_sum                     pip install "llmrl[reasoning-gym]"
    --task reasoning_gym:chain_sum,spell_backward      a mixture (task_args weights: {name: weight})

reasoning-gym: procedural datasets (`reasoning_gym.create_dataset(name, size=, seed=, **config)`), each
item scored by the dataset's own `score_answer(extract_answer(completion), item)` (partial credit where
the dataset gives it), with reasoning-gym's default system prompt asking for `<answer>…</answer>`.
Training items come from `size` items seeded by the run's seed; eval items from another seed, minus any
whose question is also a training item (the data report counts them). task_args: size, eval_size,
weights ({name: weight}), configs ({name: {option: value}}: the dataset's own options), system_prompt
(one of reasoning-gym's SYSTEM_PROMPTS names, or text).

Logged: reward/score (the mean score), and with several datasets reward/<name> (each dataset's mean score
over its own rows, a metric outside the total); eval/score, eval/correct (full credit) and, with several
datasets, eval/<name>/score and eval/<name>/correct. pass@k counts full credit only.
"""

from __future__ import annotations

import importlib
import random
from typing import Any

from llmrl.errors import ConfigError, DataError
from llmrl.tasks.base import Example, Judgement, Reward, SeededSampling, mean_of

EXTRAS = {"reasoning_gym": "reasoning-gym"}  # the library's module → its llmrl extra
EVAL_SEED_OFFSET = 1_000_003


def import_library(module: str):
    """The library's module, or one ConfigError line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"task {module}:…: the {module} library is not installed ({e}); install it with "
                          f"pip install \"llmrl[{EXTRAS.get(module, module)}]\"") from None


def is_library_task(name: str) -> bool:
    return name.partition(":")[0] in LIBRARY_TASKS and bool(name.partition(":")[2])


def library_task(name: str, seed: int, task_args: dict[str, Any]) -> Any:
    """The task of `LIBRARY:NAME[,NAME…]`, built with the run's seed and task_args."""
    from llmrl.tasks.custom import construct

    library, _, names = name.partition(":")
    return construct(name, LIBRARY_TASKS[library], {"seed": seed, "names": names} | task_args)


class ReasoningGymTask(SeededSampling):
    """One or a weighted mixture of reasoning-gym datasets, scored by reasoning-gym itself."""

    name = "reasoning_gym"
    eval_n_default = 128

    def __init__(self, seed: int = 0, names: str = "", size: int = 5000, eval_size: int = 256,
                 weights: dict[str, float] | None = None, configs: dict[str, dict[str, Any]] | None = None,
                 system_prompt: str = "default"):
        rg = import_library("reasoning_gym")
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.extract_answer = extract_answer
        self.names = [n.strip() for n in names.split(",") if n.strip()]
        if not self.names:
            raise ConfigError("task reasoning_gym:NAME[,NAME…]: name at least one dataset")
        unknown = [n for n in self.names if n not in rg.factory.DATASETS]
        if unknown:
            raise ConfigError(f"task reasoning_gym: no dataset {unknown[0]!r} ({len(rg.factory.DATASETS)} exist, e.g. "
                              f"{', '.join(sorted(rg.factory.DATASETS)[:5])})")
        weights, configs = dict(weights or {}), dict(configs or {})
        if set(weights) - set(self.names) or set(configs) - set(self.names):
            raise ConfigError(f"task_args weights/configs name datasets outside {self.names}")
        self.weights = [float(weights.get(n, 1.0)) for n in self.names]
        if not all(w >= 0 for w in self.weights) or not any(self.weights):
            raise ConfigError(f"task_args weights {weights}: must be non-negative, not all 0")
        self.system = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.rng = random.Random(seed)
        self.datasets, self.train, self.eval = {}, {}, []
        report: dict[str, Any] = {"datasets": {}}
        for n in self.names:
            try:
                ds = rg.create_dataset(n, size=size, seed=seed, **configs.get(n, {}))
                held = rg.create_dataset(n, size=eval_size, seed=seed + EVAL_SEED_OFFSET, **configs.get(n, {}))
            except Exception as e:  # noqa: BLE001 - a bad option of the dataset's own config
                raise ConfigError(f"task reasoning_gym:{n}: create_dataset raised {type(e).__name__}: {e}") from None
            self.datasets[n] = ds
            self.train[n] = [ds[i] for i in range(len(ds))]
            seen = {item["question"] for item in self.train[n]}
            fresh = [item for item in (held[i] for i in range(len(held))) if item["question"] not in seen]
            self.eval += [(n, item) for item in fresh]
            report["datasets"][n] = {"train": len(self.train[n]), "eval": len(fresh),
                                     "eval_dropped_as_in_train": len(held) - len(fresh)}
        self.data_report = report
        if not self.eval:
            raise DataError(f"task reasoning_gym:{names}: every eval item is also a training item; raise eval_size or "
                            "lower size")
        if len(self.names) > 1:  # eval interleaves the datasets, so the first eval_n hold each of them
            by_name = {n: [e for e in self.eval if e[0] == n] for n in self.names}
            self.eval = [pair for group in zip(*by_name.values()) for pair in group] + [
                pair for n in self.names for pair in by_name[n][min(map(len, by_name.values())):]]

    def example(self, name: str, item: dict[str, Any]) -> Example:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": item["question"]}]
        return Example(messages=messages, answer=item["answer"], meta={"dataset": name, "item": item})

    def sample_train_batch(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            name = self.rng.choices(self.names, weights=self.weights)[0]
            out.append(self.example(name, self.train[name][self.rng.randrange(len(self.train[name]))]))
        return out

    def eval_examples(self, n: int) -> list[Example]:
        return [self.example(name, item) for name, item in self.eval[:n]]

    def score(self, example: Example, completion: str) -> tuple[float, str | None]:
        """(reasoning-gym's score of the completion's answer, that answer)."""
        name = example.meta["dataset"]
        answer = self.extract_answer(completion)
        return float(self.datasets[name].score_answer(answer, example.meta["item"])), answer

    def reward(self, example: Example, completion: str) -> Reward:
        s, _ = self.score(example, completion)
        metrics = {example.meta["dataset"]: s} if len(self.names) > 1 else {}
        return Reward(total=s, components={"score": s}, metrics=metrics)

    def judge(self, examples: list[Example], completions: list[str]) -> list[Judgement]:
        scored = [self.score(ex, c) for ex, c in zip(examples, completions, strict=True)]
        return [Judgement(s == 1.0, answer) for s, answer in scored]

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        scores = [(ex.meta["dataset"], self.score(ex, c)[0]) for ex, c in zip(examples, completions, strict=True)]
        out = {"score": mean_of([s for _, s in scores]), "correct": mean_of([s == 1.0 for _, s in scores])}
        if len(self.names) > 1:
            for n in self.names:
                mine = [s for name, s in scores if name == n]
                if mine:
                    out[f"{n}/score"], out[f"{n}/correct"] = mean_of(mine), mean_of([s == 1.0 for s in mine])
        return out


LIBRARY_TASKS: dict[str, type] = {"reasoning_gym": ReasoningGymTask}
