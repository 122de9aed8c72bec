"""GPUActor: owns the model weights and KV cache (the ModelRunner) and runs each step in a
dedicated thread, so the event loop keeps serving Redis while the model computes.

Steps run one after another in submission order; with overlapped steps the scheduler
submits step N+1 while N runs, so the thread starts it the moment N ends."""
import asyncio
from concurrent.futures import ThreadPoolExecutor

from actors.base import Actor
from engine.model_runner import ModelRunner
from engine.plan import StepPlan, StepResult

RANK_WATCH_INTERVAL_S = 0.5


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
        """The thread does the work; this task marks the actor alive and, with tensor-parallel
        ranks, checks they live: one that died crashes the actor, so the replica stops (its
        jobs' leases lapse and another replica reclaims them) even while no step runs."""
        workers = self.runner.workers
        if workers is None:
            await asyncio.Event().wait()
        while True:
            await asyncio.sleep(RANK_WATCH_INTERVAL_S)
            workers.check_alive()

    async def stop(self) -> None:
        await super().stop()
        self.executor.shutdown(wait=True)
