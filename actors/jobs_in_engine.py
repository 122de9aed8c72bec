"""JobsInEngine: the scheduler role's state, whichever way the engine runs (on a thread of
this process: actors/scheduler_actor.py; in a process of its own: actors/engine_core.py).
It owns the deliveries of the jobs in the engine, why each was aborted, cancels that came
before their job, and deadlines; a step's outputs go from here to the publisher with their
deliveries."""
import asyncio
import time
from collections import OrderedDict

from actors.base import Actor
from actors.messages import AbortJob, Delivery, NewJob, StepOutputs
from actors.metrics import ReplicaMetrics
from engine.outputs import RequestOutput
from engine.sequence import Sequence

EARLY_CANCEL_MEMORY_S = 60.0  # a cancel can overtake its job on the way in: remember it this long
EARLY_CANCEL_MAX = 4096  # ... and at most this many of them (oldest forgotten first)


class JobsInEngine(Actor):
    name = "scheduler"
    mailbox_size = 1024

    def __init__(self, publisher: Actor, metrics: ReplicaMetrics, job_hooks: tuple = ()):
        super().__init__()
        self.job_hooks = job_hooks  # test-only seam (actors/faults.py): called with each new job's metadata
        self.publisher = publisher
        self.metrics = metrics
        self.deliveries: dict[str, Delivery] = {}  # job id -> its delivery, while in the engine
        self.abort_reasons: dict[str, str] = {}  # job id -> why it was aborted, until its last output
        self.early_cancels: OrderedDict[str, float] = OrderedDict()  # job id -> when its cancel came, oldest first
        self.steps = 0

    @property
    def num_jobs(self) -> int:
        return len(self.deliveries)

    # what each way of running the engine does
    def add_to_engine(self, seq: Sequence) -> None:
        raise NotImplementedError

    def abort_in_engine(self, job_id: str) -> None:
        raise NotImplementedError

    async def publish(self, outputs: list[RequestOutput], stats: dict) -> None:
        """One step's outputs to the publisher; a finished job leaves the engine's jobs here."""
        self.metrics.record_step(stats, outputs)
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
            self.add_to_engine(message.seq)
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
            self.abort_in_engine(job_id)

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
