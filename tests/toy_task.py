"""A task for end-to-end tests on a random tiny model: any text earns a reward that varies between
completions (the share of distinct characters), so advantages are non-zero and LoRA weights move."""

import random

from llmrl.tasks.base import Example, Reward, SeededSampling


class CharTask(SeededSampling):
    name = "chars"
    eval_n_default = 2

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    @staticmethod
    def example(i: int) -> Example:
        return Example(messages=[{"role": "user", "content": f"Say something about {i}."}], answer=i)

    def sample_train_batch(self, n):
        return [self.example(self.rng.randint(0, 99)) for _ in range(n)]

    def eval_examples(self, n):
        return [self.example(i) for i in range(n)]

    def reward(self, example, completion):
        distinct = len(set(completion)) / max(len(completion), 1)
        return Reward(total=distinct, components={"distinct": distinct})

    def evaluate(self, examples, completions):
        return {"distinct": sum(self.reward(e, c).total for e, c in zip(examples, completions)) / max(len(examples), 1)}


class RaisingTask(CharTask):
    """Like CharTask, but the reward raises on every third completion."""

    calls = 0

    def reward(self, example, completion):
        RaisingTask.calls += 1
        if RaisingTask.calls % 3 == 0:
            raise RuntimeError("grader crashed")
        return super().reward(example, completion)
