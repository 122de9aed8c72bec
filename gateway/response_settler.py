"""Background responses noticed at their end without a GET, for the namespaces with a webhook:
one task per such namespace runs `settle(namespace)` (responses.settle_finished: the pending
background responses whose job ended, saved final, which queues each one's response.* event
once) every SETTLE_EVERY_S. Without a webhook, a background response is settled lazily, on
GET, as before."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger("conveyor.gateway.webhooks")
SETTLE_EVERY_S = 1.0
STOP_WAIT_S = 5.0


class ResponseSettlers:
    def __init__(
        self, namespaces: list[str], settle: Callable[[str], Awaitable[int]], every_s: float = SETTLE_EVERY_S
    ) -> None:
        self.namespaces, self.settle, self.every_s = namespaces, settle, every_s
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(ns), name=f"settle responses {ns}") for ns in self.namespaces]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=STOP_WAIT_S) if self._tasks else None

    async def _run(self, namespace: str) -> None:
        failures = 0
        while True:
            try:
                await self.settle(namespace)
                failures = 0
            except Exception as exc:  # Redis away, a key of the wrong type: the next round tries again
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("settling background responses of %s failed (%d times): %s", namespace, failures, exc)
            await asyncio.sleep(self.every_s * min(failures + 1, 30))
