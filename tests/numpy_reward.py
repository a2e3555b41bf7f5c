"""Tasks for tests whose values are not plain Python: rewards, counts, answers and eval metrics as NumPy and
torch scalars (the logs must hold them as plain numbers), and task state a checkpoint cannot hold."""

import numpy as np
import torch

from llmrl.tasks.base import Reward
from toy_task import CharTask

KINDS = (np.float64, np.float32, lambda x: torch.tensor(x), np.int64, np.bool_)


def reward(prompt, completion, **meta):
    """A reward function: 0 or 1 by the completion's length, as one of five scalar types by its length too."""
    return KINDS[len(completion) % len(KINDS)](len(completion) % 2)


class NumpyTask(CharTask):
    """CharTask with every number a NumPy or torch scalar."""

    @staticmethod
    def example(i):
        ex = CharTask.example(i)
        ex.answer = np.int64(i)
        return ex

    def reward(self, example, completion):
        distinct, long = super().reward(example, completion).total, np.bool_(len(completion) > 3)
        return Reward(total=np.float32(distinct + long), components={"distinct": torch.tensor(distinct), "long": long},
                      counts={"chars": np.int64(len(completion))})

    def evaluate(self, examples, completions):
        return {"distinct": np.float32(0.5), "count": np.int64(len(completions)), "flag": np.bool_(True)}


class SetStateTask(CharTask):
    """CharTask whose state_dict holds a set, which JSON (and so a checkpoint) cannot."""

    def state_dict(self):
        return {**super().state_dict(), "seen": {1, 2}}
