"""SchedulerActor: owns the engine's scheduler state. Between steps it applies new jobs
and aborts; each iteration sends the step plan to the GPU actor, waits for the sampled
tokens, and hands the step's outputs to the publisher."""
import asyncio
import time
from collections import OrderedDict

from actors.base import Actor, drain
from actors.gpu import GPUActor
from actors.messages import AbortJob, Delivery, NewJob, StepOutputs
from actors.metrics import ReplicaMetrics
from engine import LLMEngine

IDLE_POLL_S = 1.0
EARLY_CANCEL_MEMORY_S = 60.0  # a cancel can overtake its job on the way in: remember it this long
EARLY_CANCEL_MAX = 4096  # ... and at most this many of them (oldest forgotten first)


class SchedulerActor(Actor):
    name = "scheduler"
    mailbox_size = 1024

    def __init__(self, engine: LLMEngine, gpu: GPUActor, publisher: Actor, metrics: ReplicaMetrics,
                 job_hooks: tuple = ()):
        super().__init__()
        self.job_hooks = job_hooks  # test-only seam (actors/faults.py): called with each new job's metadata
        self.engine = engine
        self.metrics = metrics
        self.gpu = gpu
        self.publisher = publisher
        self.deliveries: dict[str, Delivery] = {}  # job id -> its delivery, while in the engine
        self.abort_reasons: dict[str, str] = {}  # job id -> why it was aborted, until its last output
        self.early_cancels: OrderedDict[str, float] = OrderedDict()  # job id -> when its cancel came, oldest first
        self.steps = 0

    @property
    def num_jobs(self) -> int:
        return len(self.deliveries)

    async def run(self) -> None:
        while not self.stopped:
            for message in drain(self.mailbox):
                self._apply(message)
            self._expire_deadlines()
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
        self.metrics.record_step(self.engine.stats(), outputs)
        items = []
        for output in outputs:
            delivery = self.deliveries[output.request_id]
            abort_reason = None
            if output.finished:
                del self.deliveries[output.request_id]
                abort_reason = self.abort_reasons.pop(output.request_id, None)
            items.append((delivery, output, abort_reason))
        if items:
            await self.publisher.send(StepOutputs(items))

    async def _wait_for_mail(self, timeout: float) -> None:
        try:
            self._apply(await asyncio.wait_for(self.mailbox.get(), timeout))
        except asyncio.TimeoutError:
            pass

    def _apply(self, message) -> None:
        if isinstance(message, NewJob):
            for hook in self.job_hooks:
                hook(message.delivery.metadata)
            self.deliveries[message.delivery.job_id] = message.delivery
            self.engine.add_sequence(message.seq)
            if self.early_cancels.pop(message.delivery.job_id, None) is not None:
                self._abort(message.delivery.job_id, "cancelled")
        elif isinstance(message, AbortJob):
            if message.job_id in self.deliveries:
                self._abort(message.job_id, message.reason)
            else:
                self._remember_early_cancel(message.job_id)

    def _abort(self, job_id: str, reason: str) -> None:
        if job_id not in self.abort_reasons:
            self.abort_reasons[job_id] = reason
            self.engine.abort_request(job_id)

    def _remember_early_cancel(self, job_id: str) -> None:
        """O(1) amortized: expired or surplus entries leave from the old end."""
        now = time.time()
        self.early_cancels.pop(job_id, None)
        self.early_cancels[job_id] = now
        while self.early_cancels and (len(self.early_cancels) > EARLY_CANCEL_MAX
                                      or now - next(iter(self.early_cancels.values())) >= EARLY_CANCEL_MEMORY_S):
            self.early_cancels.popitem(last=False)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for job_id, delivery in list(self.deliveries.items()):
            if delivery.deadline is not None and delivery.deadline <= now:
                self._abort(job_id, "deadline_exceeded")
