"""Surviving Redis going away: every replica operation retries with capped exponential
backoff until the server is back, and a consumer group lost with the server's data
(NOGROUP) is recreated. Generation keeps going meanwhile; nothing is dropped."""

import asyncio
import logging
from typing import Any, Awaitable, Callable, TypeVar

from redis.exceptions import AskError, ClusterError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.clients.log_limits import RateLimitedLog, shown
from conveyor.clients.redis_cluster import FAILOVER_ERRORS

log = logging.getLogger(__name__)
T = TypeVar("T")
# a slot on the move past what the cluster client follows itself: MOVED/ASK, or TRYAGAIN
# until its redirection budget ran out (ClusterError "TTL exhausted")
SLOT_MOVING_ERRORS = (ClusterError, AskError)
# a lost connection, or a cluster slot between masters (failover) or nodes: wait and retry
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, *FAILOVER_ERRORS, *SLOT_MOVING_ERRORS)
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0


def closed_transport(exc: BaseException) -> bool:
    """A write on a connection torn down under it, which redis-py lets through when a
    cluster master dies mid-send: uvloop's "handler is closed", or (redis-py 7, while it
    reconnects) its writer already gone. A lost connection, not a bug."""
    if isinstance(exc, RuntimeError):
        return "handler is closed" in str(exc)
    return isinstance(exc, AttributeError) and str(exc).startswith("'NoneType' object has no attribute 'write")


def transient(exc: BaseException) -> bool:
    """An error that says the server (or the slot's node) could not serve the command now, not
    that the command is wrong: sent again, it may go through."""
    return isinstance(exc, CONNECTION_ERRORS) or closed_transport(exc)


async def retrying(
    operation: Callable[[], Awaitable[T]], what: str, recreate_groups: Callable[[], Awaitable[None]] | None = None
) -> T:
    """Run ``operation`` until it succeeds. Connection loss: wait and retry. NOGROUP: recreate
    the groups (the server restarted without its data) and retry. Other errors propagate."""
    backoff = FIRST_BACKOFF_S
    failures = 0
    groups_missing = False
    while True:
        try:
            if groups_missing:
                await recreate_groups()
                groups_missing = False
            result = await operation()
            if failures:
                log.warning("%s: Redis is back after %d failed attempts", what, failures)
            return result
        except (*CONNECTION_ERRORS, RuntimeError, AttributeError) as exc:
            if isinstance(exc, (RuntimeError, AttributeError)) and not closed_transport(exc):
                raise
            failures += 1
            if failures == 1 or failures % 20 == 0:
                log.warning("%s: Redis unavailable (%s); retrying", what, exc)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc) or recreate_groups is None:
                raise
            log.warning("%s: consumer group missing (server lost its data?); recreating it", what)
            groups_missing = True
            continue
        await asyncio.sleep(backoff)
        backoff = min(MAX_BACKOFF_S, backoff * 2)


RESUBSCRIBE_S = 0.5


async def keep_subscribed(
    stopped: Callable[[], bool],
    subscribe: Callable[[], Any],
    follow: Callable[[Any], Awaitable[None]],
    what: str,
    warnings: RateLimitedLog,
) -> None:
    """Subscribe (an async context manager) and `follow` the subscription until `stopped()`;
    a lost connection or anything a message did is logged and the subscription made again:
    no input may stop the replica."""
    while not stopped():
        try:
            async with subscribe() as subscription:
                await follow(subscription)
        except CONNECTION_ERRORS as exc:
            log.warning("%s lost (%s); resubscribing", what, exc)
        except Exception as exc:  # noqa: BLE001 - no input may stop the replica
            warnings.warning("listen", "%s failed (%s); resubscribing", what, shown(exc, 200))
        await asyncio.sleep(RESUBSCRIBE_S)
