"""CancelWatcher: turns cancellation requests into AbortJob messages for the scheduler.

Requests arrive on the ``<ns>:cancel`` pub/sub channel (immediate, any replica may own the
job); pub/sub loses messages while disconnected, so the ``cancel`` flags of the jobs this
replica holds are also polled."""
import asyncio
import logging

from actors.base import Actor
from actors.leases import Leases
from actors.messages import AbortJob
from actors.resilience import CONNECTION_ERRORS
from actors.streams import Streams

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 2.0


class CancelWatcher(Actor):
    name = "cancel-watcher"

    def __init__(self, streams: Streams, leases: Leases, scheduler: Actor):
        super().__init__()
        self.streams = streams
        self.leases = leases
        self.scheduler = scheduler

    async def run(self) -> None:
        await asyncio.gather(self._listen(), self._poll())

    async def _listen(self) -> None:
        while not self.stopped:
            try:
                async with self.streams.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.streams.keys.cancel)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            await self.scheduler.send(AbortJob(message["data"].decode(), "cancelled"))
            except CONNECTION_ERRORS as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
            await asyncio.sleep(0.5)

    async def _poll(self) -> None:
        while not self.stopped:
            await asyncio.sleep(POLL_INTERVAL_S)
            job_ids = list(self.leases.held)
            if not job_ids:
                continue

            async def read_flags():
                async with self.streams.redis.pipeline(transaction=False) as pipe:
                    for job_id in job_ids:
                        pipe.hget(self.streams.keys.job(job_id), "cancel")
                    return await pipe.execute()
            flags = await self.streams.resilient(read_flags, "poll cancel flags")
            for job_id, flag in zip(job_ids, flags):
                if flag == b"1":
                    await self.scheduler.send(AbortJob(job_id, "cancelled"))
