"""A minimal actor: one task, one bounded mailbox, owned state nobody else touches.

A crash in any actor is reported to the replica's supervisor, which stops everything and
exits non-zero: a replica never limps on with a dead actor or hangs silently.
"""

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


class Actor:
    name = "actor"
    mailbox_size = 64

    def __init__(self):
        self.mailbox: asyncio.Queue = asyncio.Queue(self.mailbox_size)
        self._task: asyncio.Task | None = None
        self.stopped = False  # loops check it: cancellation alone can be lost (see stop)
        self._on_crash: Callable[[str, BaseException], None] = _log_crash

    def start(self, on_crash: Callable[[str, BaseException], None] | None = None) -> None:
        if on_crash is not None:
            self._on_crash = on_crash
        self._task = asyncio.create_task(self._guarded_run(), name=self.name)

    async def stop(self) -> None:
        # on Python 3.11 a cancellation landing inside redis-py's asyncio.wait_for can be
        # swallowed (CPython gh-86296): loops also check ``stopped``, and we cancel until done
        self.stopped = True
        while self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=0.05)

    async def send(self, message: Any) -> None:
        """Waits while the mailbox is full: back-pressure instead of unbounded memory."""
        await self.mailbox.put(message)

    async def ask(self, message: Any) -> Any:
        """Send a message that carries a ``reply`` future and wait for the answer."""
        await self.send(message)
        return await message.reply

    async def run(self) -> None:
        raise NotImplementedError

    async def _guarded_run(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any crash must stop the replica loudly
            self._on_crash(self.name, exc)


def _log_crash(name: str, exc: BaseException) -> None:
    log.critical("actor %s crashed", name, exc_info=exc)


def drain(queue: asyncio.Queue) -> list:
    """Everything queued right now, without waiting."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
