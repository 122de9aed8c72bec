"""GPUActor: owns the model weights and KV cache (the ModelRunner) and runs each step in a
dedicated thread, so the event loop keeps serving Redis while the model computes.

Steps run one after another in submission order; with overlapped steps the scheduler
submits step N+1 while N runs, so the thread starts it the moment N ends."""
import asyncio
from concurrent.futures import ThreadPoolExecutor

from actors.base import Actor
from engine.model_runner import ModelRunner
from engine.plan import StepPlan, StepResult


class GPUActor(Actor):
    name = "gpu"

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-gpu")

    def submit(self, plan: StepPlan) -> "asyncio.Future[StepResult]":
        """Queue a step; the future holds its sampled tokens (or the runner's exception)."""
        return asyncio.get_running_loop().run_in_executor(self.executor, self.runner.execute, plan)

    async def run(self) -> None:
        await asyncio.Event().wait()  # the thread does the work; this task only marks the actor alive

    async def stop(self) -> None:
        await super().stop()
        self.executor.shutdown(wait=True)
