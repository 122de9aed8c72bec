"""SchedulerActor: the scheduler role when the engine runs in this process (tests, the demo;
``conveyor serve`` runs it in a process of its own, actors/engine_core.py). It owns the
engine's scheduler state: between steps it applies new jobs and aborts; each iteration
sends a step plan to the GPU actor and, once a step's sampled tokens are back, hands that
step's outputs to the publisher.

With overlapped steps (the default; ``async_scheduling=False`` turns them off) two steps are in flight: step N+1 is
planned and queued while N runs, and N's tokens are applied (detokenized, stop checks,
published) while N+1 runs; the runner feeds N's tokens into N+1 itself."""
from collections import deque

from actors.base import Actor, drain
from actors.gpu import GPUActor
from actors.jobs_in_engine import JobsInEngine
from actors.metrics import ReplicaMetrics
from engine import LLMEngine
from engine.sequence import Sequence

IDLE_POLL_S = 1.0


class SchedulerActor(JobsInEngine):
    def __init__(self, engine: LLMEngine, gpu: GPUActor, publisher: Actor, metrics: ReplicaMetrics,
                 job_hooks: tuple = ()):
        super().__init__(publisher, metrics, job_hooks)
        self.engine = engine
        self.gpu = gpu
        self.in_flight: deque = deque()  # (plan, future of its result), oldest first
        # overlapped unless turned off: 1.00-1.30x per round on the 2-core CPU (docs/performance.md)
        self.max_in_flight = 1 if engine.config.async_scheduling is False else 2

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
        await self.publish(outputs, self.engine.stats())

    def add_to_engine(self, seq: Sequence) -> None:
        self.engine.add_sequence(seq)

    def abort_in_engine(self, job_id: str) -> None:
        self.engine.abort_request(job_id)
