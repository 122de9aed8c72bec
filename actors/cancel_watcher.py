"""CancelWatcher: turns cancellation requests into CancelRequests for the ledger, which
sends the engine-core actor an AbortJob for a job it holds.

Requests arrive on the ``<ns>:cancel`` pub/sub channel (immediate, any replica may own the
job); pub/sub loses messages while disconnected, so the ``cancel`` flags of the jobs this
replica holds are also polled.

Both are producer input: a message that is not a well-formed job id is logged
(rate-limited) and dropped, and only ids of jobs this replica holds go further (the
ledger decides, one request at a time), so a flood of cancels costs O(1) each and no
memory. (A cancel cannot be missed for a job on its way in: the cancel flag is set before
the message is published, and starting an attempt reads the flag.)"""

import asyncio
import logging
import re

from conveyor.actors.base import Actor
from conveyor.actors.messages import CancelRequest, HeldJobs
from conveyor.actors.resilience import keep_subscribed
from conveyor.actors.streams import Streams
from conveyor.clients.limits import JOB_ID_PATTERN
from conveyor.clients.log_limits import RateLimitedLog, shown

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 2.0
_JOB_ID = re.compile(JOB_ID_PATTERN.encode())


class CancelWatcher(Actor):
    name = "cancel-watcher"

    def __init__(self, streams: Streams, ledger: Actor):
        super().__init__()
        self.streams = streams
        self.ledger = ledger
        self.warnings = RateLimitedLog(log)

    async def run(self) -> None:
        await asyncio.gather(self._listen(), self._poll())

    async def _listen(self) -> None:
        stopped = lambda: self.stopped  # noqa: E731
        await keep_subscribed(stopped, self.streams.cancel_messages, self._follow, "cancel channel", self.warnings)

    async def _follow(self, messages) -> None:
        async for message in messages:
            await self._on_message(message)

    async def _on_message(self, message) -> None:
        if not isinstance(message, dict) or message.get("type") != "message":
            return
        job_id = job_id_of(message.get("data"))
        if job_id is None:
            self.warnings.warning(
                "bad-cancel", "dropped a cancel message that is not a job id: %s", shown(message.get("data"))
            )
        else:
            await self.ledger.ask(CancelRequest(job_id))

    async def _poll(self) -> None:
        while not self.stopped:
            await asyncio.sleep(POLL_INTERVAL_S)
            job_ids = await self.ledger.ask(HeldJobs())
            if job_ids:
                await self._poll_flags(job_ids)

    async def _poll_flags(self, job_ids: list[str]) -> None:
        for job_id, flagged in zip(job_ids, await self.streams.cancel_flags(job_ids)):
            if flagged:
                await self.ledger.ask(CancelRequest(job_id))  # still held? the ledger knows


def job_id_of(data) -> str | None:
    """The job id a cancel message carries, or None when it is not a well-formed one."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > 128 or not _JOB_ID.fullmatch(data):
        return None
    return bytes(data).decode("ascii")
