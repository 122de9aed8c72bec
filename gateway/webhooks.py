"""The gateway's webhook sender: delivers each namespace's queued events (clients/webhook_queue.py)
to the receiver the operator configured for it (webhook_config.py), signed (webhook_signing.py),
at least once, across restarts and gateways.

Every gateway of a namespace with a webhook reads its events stream in the consumer group
WEBHOOK_GROUP (XREADGROUP), so each event is delivered by one gateway at a time. An event
being delivered, or waiting between retries, is *held* by this gateway: it stays in the
group's pending list and is touched (XCLAIM to self) every third of `claim_idle_s`, so no
other gateway takes it; an event left pending longer than `claim_idle_s` (its gateway died or
restarted) is taken over with XAUTOCLAIM. Success (2xx): XACK + XDEL. A failure is retried with
exponential backoff and jitter (1, 2, 4 ... s, at most 5 min) until the event is older than
the target's retry window, then dead-lettered to `webhooks_dead` (with `reason`, `attempts`,
`failed_at`); a malformed entry is dead-lettered at once.

Each event is delivered by its own task; at most `concurrency` attempts per namespace are in
flight (a semaphore, and the namespace's own HTTP connection pool), so a receiver that never
answers holds only its own namespace's slots, and an event waiting for a retry holds none.
A namespace holds at most MAX_HELD events at once on one gateway (it reads no more until
some are settled). Redis errors (a key of the wrong type included) are logged, rate-limited,
and retried with backoff; nothing a receiver or a stream entry does stops the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from typing import Any

from redis.exceptions import RedisError, ResponseError

from conveyor.clients.keys import Keys
from conveyor.clients.log_limits import RateLimitedLog
from conveyor.clients.webhook_queue import (
    EVENT_FIELDS,
    MAX_DEAD_EVENTS,
    WEBHOOK_GROUP,
    check_event,
    event_body,
)
from conveyor.gateway.webhook_config import WebhookTarget
from conveyor.gateway.webhook_delivery import MAX_REASON_CHARS, attempt, cut, http_client

log = logging.getLogger("conveyor.gateway.webhooks")
CLAIM_IDLE_S = 60.0  # an event pending this long is another (dead) gateway's: taken over
MAX_HELD = 512  # events one namespace holds on one gateway (in an attempt or waiting to retry)
READ_COUNT = 64  # entries one read takes at most
BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 300.0
REDIS_BACKOFF_CAP_S = 30.0
LOG_EVERY_S = 10.0

# Touch the events this consumer still owns (reset their idle time, so that no gateway
# takes them over); returns those ids. KEYS: the stream. ARGV: group, consumer, ids...
TOUCH_LUA = """
local kept = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if entry and entry[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept[#kept + 1] = ARGV[i]
  end
end
return kept
"""


def retry_delay(attempts: int) -> float:
    """Seconds before the next attempt after `attempts` failed ones: 1, 2, 4 ... capped at
    BACKOFF_CAP_S, each jittered down to between half and all of it."""
    nominal = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(max(attempts - 1, 0), 30))
    return nominal * random.uniform(0.5, 1.0)


def new_consumer() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class WebhookSender:
    """The gateway's deliveries: one NamespaceSender task per namespace with a webhook."""

    def __init__(
        self,
        redis: Any,
        targets: dict[str, tuple[Keys, WebhookTarget]],
        *,
        consumer: str | None = None,
        claim_idle_s: float = CLAIM_IDLE_S,
    ) -> None:
        self.consumer = consumer or new_consumer()
        self.senders = [
            NamespaceSender(redis, keys, target, self.consumer, claim_idle_s) for keys, target in targets.values()
        ]
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        for sender in self.senders:
            log.info("webhooks of namespace %s go to %s", sender.keys.ns, sender.target.host)
        self._tasks = [asyncio.create_task(s.run(), name=f"webhooks {s.keys.ns}") for s in self.senders]

    async def stop(self) -> None:
        """Stop reading and delivering: what was held stays pending, for the next sender."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self.senders), return_exceptions=True)


class NamespaceSender:
    """Delivers one namespace's events; the one owner of what it holds (`held`)."""

    def __init__(self, redis: Any, keys: Keys, target: WebhookTarget, consumer: str, claim_idle_s: float) -> None:
        self.redis, self.keys, self.target, self.consumer = redis, keys, target, consumer
        self.stream, self.dead_stream = keys.webhooks, keys.webhooks_dead
        self.claim_idle_s = claim_idle_s
        self.block_s = min(1.0, claim_idle_s / 4)
        self.held: dict[str, asyncio.Task] = {}  # entry id -> its delivery task
        self.slots = asyncio.Semaphore(target.concurrency)
        self.http = http_client(target)
        self.warn = RateLimitedLog(log, LOG_EVERY_S)
        self._touch = redis.register_script(TOUCH_LUA)
        self._room = asyncio.Event()
        self._cursor = "0-0"  # of XAUTOCLAIM's walk over the pending list
        self._claim_at = self._touch_at = 0.0

    async def run(self) -> None:
        failures = 0
        try:
            while True:
                try:
                    await self._create_group()
                    while True:
                        await self._round()
                        failures = 0
                except Exception as exc:  # Redis away, a key of the wrong type, the group deleted; or a bug
                    failures += 1
                    delay = min(REDIS_BACKOFF_CAP_S, 0.5 * 2 ** min(failures, 10))
                    kind = "redis" if isinstance(exc, RedisError) else "unexpected"
                    self.warn.warning(
                        kind,
                        "webhooks of namespace %s: %s; again in %.0f s",
                        self.keys.ns,
                        exc,
                        delay,
                        exc_info=kind == "unexpected",
                    )
                    await asyncio.sleep(delay)
        finally:
            await self._let_go()

    async def close(self) -> None:
        await self.http.aclose()

    async def _create_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, WEBHOOK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _round(self) -> None:
        """Take over idle events and touch held ones when due, then read new events."""
        now = time.monotonic()
        if now >= self._claim_at:
            await self._claim_idle()
            self._claim_at = now + self.claim_idle_s / 4
        if now >= self._touch_at:
            await self._touch_held()
            self._touch_at = now + self.claim_idle_s / 3
        room = MAX_HELD - len(self.held)
        if room <= 0:
            self._room.clear()
            await _wait(self._room, self.block_s)
            return
        reply = await self.redis.xreadgroup(
            WEBHOOK_GROUP,
            self.consumer,
            {self.stream: ">"},
            count=min(room, READ_COUNT),
            block=int(self.block_s * 1000),
        )
        for _, entries in reply.items() if isinstance(reply, dict) else reply or []:
            for entry_id, fields in entries:
                self._hold(entry_id, fields)

    async def _claim_idle(self) -> None:
        room = MAX_HELD - len(self.held)
        if room <= 0:
            return
        reply = await self.redis.xautoclaim(
            self.stream,
            WEBHOOK_GROUP,
            self.consumer,
            min_idle_time=int(self.claim_idle_s * 1000),
            start_id=self._cursor,
            count=min(room, READ_COUNT),
        )
        self._cursor = _text(reply[0])
        entries = reply[1] or []
        gone = [entry_id for entry_id, fields in entries if entry_id and not fields]
        gone += list(reply[2]) if len(reply) > 2 and reply[2] else []  # deleted from the stream meanwhile
        if gone:
            await self.redis.xack(self.stream, WEBHOOK_GROUP, *gone)
        for entry_id, fields in entries:
            if entry_id and fields:
                self._hold(entry_id, fields)

    async def _touch_held(self) -> None:
        """Reset the idle time of the events held; one another gateway took over is let go."""
        ids = list(self.held)
        if not ids:
            return
        kept = {_text(i) for i in await self._touch(keys=[self.stream], args=[WEBHOOK_GROUP, self.consumer, *ids])}
        for entry_id in ids:
            if entry_id not in kept and entry_id in self.held:
                self.held[entry_id].cancel()

    def _hold(self, entry_id: Any, fields: dict) -> None:
        entry_id = _text(entry_id)
        if entry_id not in self.held:
            self.held[entry_id] = asyncio.create_task(self._deliver(entry_id, fields), name=f"webhook {entry_id}")

    async def _let_go(self) -> None:
        tasks = list(self.held.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one event

    async def _deliver(self, entry_id: str, fields: dict) -> None:
        try:
            try:
                event = check_event(fields)
            except ValueError as exc:
                return await self._dead(entry_id, fields, f"malformed event: {exc}", 0)
            await self._attempts(entry_id, event)
        except Exception as exc:  # settling failed (or a bug): the event stays pending, taken over once idle
            self.warn.warning(
                "settle",
                "webhooks of namespace %s: cannot settle an event: %s",
                self.keys.ns,
                exc,
                exc_info=not isinstance(exc, RedisError),
            )
        finally:
            self.held.pop(entry_id, None)
            self._room.set()

    async def _attempts(self, entry_id: str, event: dict[str, str]) -> None:
        body, attempts = event_body(event), 0
        while True:
            async with self.slots:
                reason = await attempt(self.http, self.target, event["id"], body)
            attempts += 1
            if reason is None:
                return await self._settle(entry_id)
            left = int(event["created_at"]) + self.target.retry_for_s - time.time()
            if left <= 0:
                return await self._dead(entry_id, event, reason, attempts)
            self.warn.warning(
                "attempt", "webhook to %s (namespace %s) failed: %s", self.target.host, self.keys.ns, reason[:120]
            )
            await asyncio.sleep(min(retry_delay(attempts), left))

    async def _settle(self, entry_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.stream, WEBHOOK_GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        await pipe.execute()

    async def _dead(self, entry_id: str, fields: dict, reason: str, attempts: int) -> None:
        """Dead-letter the event (first: a failed XADD leaves it pending, retried once idle)."""
        record = {name: cut(value) for name in EVENT_FIELDS if (value := _field(fields, name)) is not None}
        record.update(
            entry_id=entry_id, reason=reason[:MAX_REASON_CHARS], attempts=attempts, failed_at=int(time.time())
        )
        await self.redis.xadd(self.dead_stream, record, maxlen=MAX_DEAD_EVENTS, approximate=True)
        await self._settle(entry_id)
        self.warn.warning(
            "dead",
            "webhook event %s of namespace %s dead-lettered after %d attempts: %s",
            record.get("id", "?")[:40],
            self.keys.ns,
            attempts,
            reason[:120],
        )


def _field(fields: dict, name: str) -> str | None:
    value = fields.get(name, fields.get(name.encode()))
    return None if value is None else _text(value)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()


def sender_for(redis: Any, targets: dict[str, WebhookTarget], keys_of: Any) -> WebhookSender:
    """The sender of a gateway: `keys_of(namespace)` gives each namespace's key layout."""
    return WebhookSender(redis, {ns: (keys_of(ns), target) for ns, target in targets.items()})
