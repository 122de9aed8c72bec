"""SchedulerActor: owns the engine's scheduler state. Between steps it applies new jobs
and aborts; each iteration sends the step plan to the GPU actor, waits for the sampled
tokens, and hands the step's outputs to the publisher."""
import asyncio

from actors.base import Actor, drain
from actors.gpu import GPUActor
from actors.messages import AbortJob, Delivery, NewJob, StepOutputs
from engine import LLMEngine

IDLE_POLL_S = 1.0


class SchedulerActor(Actor):
    name = "scheduler"
    mailbox_size = 1024

    def __init__(self, engine: LLMEngine, gpu: GPUActor, publisher: Actor):
        super().__init__()
        self.engine = engine
        self.gpu = gpu
        self.publisher = publisher
        self.deliveries: dict[str, Delivery] = {}  # job id -> its delivery, while in the engine
        self.steps = 0

    @property
    def num_jobs(self) -> int:
        return len(self.deliveries)

    async def run(self) -> None:
        while True:
            for message in drain(self.mailbox):
                self._apply(message)
            wait = self.engine.seconds_until_ready() if self.engine.has_unfinished_requests() else IDLE_POLL_S
            if wait > 0:
                await self._wait_for_mail(min(wait, IDLE_POLL_S))
                continue
            await self._step()

    async def _step(self) -> None:
        plan = self.engine.schedule()
        result = await self.gpu.execute(plan)
        outputs = self.engine.postprocess(plan, result)
        self.steps += 1
        items = []
        for output in outputs:
            delivery = self.deliveries[output.request_id]
            if output.finished:
                del self.deliveries[output.request_id]
            items.append((delivery, output))
        if items:
            await self.publisher.send(StepOutputs(items))

    async def _wait_for_mail(self, timeout: float) -> None:
        try:
            self._apply(await asyncio.wait_for(self.mailbox.get(), timeout))
        except asyncio.TimeoutError:
            pass

    def _apply(self, message) -> None:
        if isinstance(message, NewJob):
            self.deliveries[message.delivery.job_id] = message.delivery
            self.engine.add_sequence(message.seq)
        elif isinstance(message, AbortJob) and message.job_id in self.deliveries:
            self.deliveries[message.job_id].abort_reason = message.reason
            self.engine.abort_request(message.job_id)
