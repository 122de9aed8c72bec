"""SchedulerActor: owns the engine's scheduler state. Between steps it applies new jobs
and aborts; each iteration sends a step plan to the GPU actor and, once a step's sampled
tokens are back, hands that step's outputs to the publisher.

With overlapped steps (the default; ``async_scheduling=False`` turns them off) two steps are in flight: step N+1 is
planned and queued while N runs, and N's tokens are applied (detokenized, stop checks,
published) while N+1 runs; the runner feeds N's tokens into N+1 itself."""
import asyncio
import time
from collections import OrderedDict, deque

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
        self.in_flight: deque = deque()  # (plan, future of its result), oldest first
        # overlapped unless turned off: 1.00-1.30x per round on the 2-core CPU (docs/performance.md)
        self.max_in_flight = 1 if engine.config.async_scheduling is False else 2

    @property
    def num_jobs(self) -> int:
        return len(self.deliveries)

    async def run(self) -> None:
        while not self.stopped:
            for message in drain(self.mailbox):
                self._apply(message)
            self._expire_deadlines()
            wait = self.engine.seconds_until_ready() if self.engine.has_unfinished_requests() else IDLE_POLL_S
            if wait <= 0:
                plan = self.engine.schedule()
                self.in_flight.append((plan, self.gpu.submit(plan)))
            if len(self.in_flight) >= self.max_in_flight or (self.in_flight and wait > 0):
                await self._complete_oldest_step()
            elif wait > 0:
                await self._wait_for_mail(min(wait, IDLE_POLL_S))

    async def _complete_oldest_step(self) -> None:
        plan, future = self.in_flight.popleft()
        outputs = self.engine.postprocess(plan, await future)
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
