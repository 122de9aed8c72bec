"""GPUActor: owns the model weights and KV cache (the ModelRunner) and runs each step in a
dedicated thread, so the event loop keeps serving Redis while the model computes."""
import asyncio
from concurrent.futures import ThreadPoolExecutor

from actors.base import Actor
from engine.model_runner import ModelRunner
from engine.plan import StepPlan, StepResult


class GPUActor(Actor):
    name = "gpu"
    mailbox_size = 1  # one step in flight

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-gpu")

    async def execute(self, plan: StepPlan) -> StepResult:
        reply = asyncio.get_running_loop().create_future()
        await self.send((plan, reply))
        return await reply

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopped:
            plan, reply = await self.mailbox.get()
            try:
                result = await loop.run_in_executor(self.executor, self.runner.execute, plan)
            except Exception as exc:
                if not reply.done():
                    reply.set_exception(exc)
                raise
            if not reply.done():  # the scheduler may have stopped waiting (shutdown)
                reply.set_result(result)

    async def stop(self) -> None:
        await super().stop()
        self.executor.shutdown(wait=True)
