"""EngineCoreActor: the replica's one actor that talks to the engine core (named
"engine_core"), whichever way the core was started (actors/engine_client.py). It owns the jobs in
the engine: their deliveries, why each was aborted, cancels that came before their job,
and deadlines. New jobs and aborts go to the core as frames; a reader task publishes each
StepDone the core sends, with the deliveries, to the publisher. The core dying ends the
actor, so the replica stops (exit 1) and another replica reclaims its jobs once their
leases lapse."""

import asyncio
import time
from collections import OrderedDict

from conveyor.actors.base import Actor, drain
from conveyor.actors.engine_client import CoreDied, EngineCoreClient
from conveyor.actors.messages import AbortJob, Delivery, NewJob, StepOutputs
from conveyor.actors.metrics import ReplicaMetrics
from conveyor.engine.engine_core import AbortRequest, AddRequest, StepDone
from conveyor.engine.outputs import RequestOutput

EARLY_CANCEL_MEMORY_S = 60.0  # a cancel can overtake its job on the way in: remember it this long
EARLY_CANCEL_MAX = 4096  # ... and at most this many of them (oldest forgotten first)
DEADLINE_POLL_S = 0.5  # the mail loop wakes at least this often (sooner for a nearer deadline)
CORE_EXIT_WAIT_S = 5.0


class EngineCoreActor(Actor):
    name = "engine_core"
    mailbox_size = 1024

    def __init__(self, core: EngineCoreClient, publishers: dict[str, Actor], metrics: ReplicaMetrics, job_hooks=()):
        """``publishers``: each namespace's (Delivery.door: "" on a replica serving one)."""
        super().__init__()
        self.core = core
        self.job_hooks = job_hooks  # test-only seam (actors/faults.py): called with each new job's metadata
        self.publishers = publishers
        self.metrics = metrics
        # keyed by request key (Delivery.request_key: the job id, after its namespace on a
        # replica serving several)
        self.deliveries: dict[str, Delivery] = {}  # its delivery, while in the engine
        self.abort_reasons: dict[str, str] = {}  # why it was aborted, until its last output
        self.early_cancels: OrderedDict[str, float] = OrderedDict()  # when its cancel came, oldest first
        self.steps = 0

    @property
    def num_jobs(self) -> int:
        return len(self.deliveries)

    async def run(self) -> None:
        await self.core.open_stream()
        halves = [asyncio.ensure_future(self._forward_mail()), asyncio.ensure_future(self._publish_steps())]
        try:
            done, _ = await asyncio.wait(halves, return_when=asyncio.FIRST_EXCEPTION)
            for half in done:
                half.result()  # the first one's exception ends the actor
        finally:
            for half in halves:
                half.cancel()  # neither half outlives the other

    async def stop(self) -> None:
        await super().stop()
        if self.core.writer is not None:
            self.core.request_shutdown()

    # ---- front door -> core ---------------------------------------------------------
    async def _forward_mail(self) -> None:
        while not self.stopped:
            await self._wait_for_mail(self._until_next_deadline())
            for message in drain(self.mailbox):
                self._apply(message)
            self._expire_deadlines()
            try:
                await self.core.drain()
            except ConnectionError:
                raise await self._core_died() from None

    async def _wait_for_mail(self, timeout: float) -> None:
        try:
            self._apply(await asyncio.wait_for(self.mailbox.get(), timeout))
        except asyncio.TimeoutError:
            pass

    def _apply(self, message) -> None:
        if isinstance(message, NewJob):
            for hook in self.job_hooks:
                hook(message.delivery.metadata)
            key = message.delivery.request_key
            self.deliveries[key] = message.delivery
            self.core.send(AddRequest(message.request))
            if self.early_cancels.pop(key, None) is not None:
                self._abort(key, "cancelled")
        elif isinstance(message, AbortJob):
            if message.request_key in self.deliveries:
                self._abort(message.request_key, message.reason)
            else:
                self._remember_early_cancel(message.request_key)

    def _abort(self, job_id: str, reason: str) -> None:
        if job_id not in self.abort_reasons:
            self.abort_reasons[job_id] = reason
            self.core.send(AbortRequest(job_id))

    def _remember_early_cancel(self, job_id: str) -> None:
        """O(1) amortized: expired or surplus entries leave from the old end."""
        now = time.time()
        self.early_cancels.pop(job_id, None)
        self.early_cancels[job_id] = now
        while self.early_cancels and (
            len(self.early_cancels) > EARLY_CANCEL_MAX
            or now - next(iter(self.early_cancels.values())) >= EARLY_CANCEL_MEMORY_S
        ):
            self.early_cancels.popitem(last=False)

    def _until_next_deadline(self) -> float:
        """Seconds to the nearest deadline of a job in the engine, within [0, DEADLINE_POLL_S]:
        a deadline is acted on when it passes, not up to a poll later."""
        deadlines = [
            d.deadline
            for job_id, d in self.deliveries.items()
            if d.deadline is not None and job_id not in self.abort_reasons  # an aborted job's is done
        ]
        if not deadlines:
            return DEADLINE_POLL_S
        return min(DEADLINE_POLL_S, max(0.0, min(deadlines) - time.time()))

    def _expire_deadlines(self) -> None:
        now = time.time()
        for job_id, delivery in list(self.deliveries.items()):
            if delivery.deadline is not None and delivery.deadline <= now:
                self._abort(job_id, "deadline_exceeded")

    # ---- core -> publisher ----------------------------------------------------------
    async def _publish_steps(self) -> None:
        while not self.stopped:
            try:
                done: StepDone = await self.core.receive()
            except (asyncio.IncompleteReadError, ConnectionError):
                raise await self._core_died() from None
            self.steps += 1
            await self.publish(done.outputs, done.stats)

    async def publish(self, outputs: list[RequestOutput], stats: dict) -> None:
        """One step's outputs to the publisher; a finished job leaves the engine's jobs here."""
        self.metrics.record_step(stats, outputs)
        items: dict[str, list] = {}  # each namespace's, for its publisher
        for output in outputs:
            delivery = self.deliveries[output.request_id]
            abort_reason = None
            if output.finished:
                del self.deliveries[output.request_id]
                abort_reason = self.abort_reasons.pop(output.request_id, None)
            items.setdefault(delivery.door, []).append((delivery, output, abort_reason))
        for door, door_items in items.items():
            await self.publishers[door].send(StepOutputs(door_items))

    async def _core_died(self) -> CoreDied:
        """Why the socket broke, once the core has ended (or CORE_EXIT_WAIT_S have passed)."""
        await self.core.wait_for_exit(CORE_EXIT_WAIT_S)
        return CoreDied(self.core.exit_description())
