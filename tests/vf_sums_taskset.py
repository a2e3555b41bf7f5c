"""A verifiers (v1) taskset for tests/test_verifiers.py: sums, scored by three weighted rewards and a metric. Loaded as verifiers loads tasksets: `--task verifiers:vf_sums_taskset`."""

import re

import verifiers.v1 as vf


class SumsConfig(vf.TasksetConfig):
    split: str = "train"
    """train: 37 rows; test: 11 other rows."""


class SumsData(vf.TaskData):
    answer: str


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.3)
    async def brevity(self, trace: vf.Trace) -> float:
        return max(0.0, 1.0 - len(trace.last_reply or "") / 7)

    @vf.reward(weight=0.5)
    async def polite(self, trace: vf.Trace) -> float:
        return float("please" in (trace.last_reply or ""))

    @vf.metric
    async def words(self, trace: vf.Trace) -> float:
        return float(len((trace.last_reply or "").split()))


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        ks = range(37) if self.config.split == "train" else range(100, 111)
        for k in ks:
            yield SumsTask(SumsData(id=f"s{k}", prompt=f"What is {k} + {2 * k + 1}?", system_prompt="Answer briefly.",
                                    answer=str(3 * k + 1)), self.config.task)


__all__ = ["SumsTaskset"]
