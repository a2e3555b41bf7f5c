"""A verifiers (v1) taskset whose reward needs a runtime (a harness's sandbox): llmrl refuses it."""

import verifiers.v1 as vf


class BoxTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return float((await runtime.run(["true"], {})).exit_code == 0)


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self):
        for k in range(3):
            yield BoxTask(vf.TaskData(id=f"b{k}", prompt="fix the bug"), self.config.task)


__all__ = ["BoxTaskset"]
