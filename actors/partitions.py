"""PartitionKeeper: the request-stream partitions this replica owns, and the wake-ups the
submit script publishes for them.

Why: a replica that polled every partition cost the cluster 2 x N read scripts per idle poll,
for every replica. Now an idle replica's cost does not depend on N: it waits on the wake
channels of the partitions it owns (the submit script PUBLISHes on the channel named like
the request stream), probes one partition at a time at a capped rate (stealing from others,
and a safety net for a missed wake: actors/ingest.py), and runs one ownership script every
lease/6 (actors/partition_scripts.py).

Ownership is a lease per partition in one hash of the namespace's slot
(`Keys.partition_owners`: field `<k>` -> `<expiry ms> <consumer>`), with the live replicas
in a sorted set beside it (`Keys.partition_takers`). One script, on the server's clock, renews
this replica's leases, gives back what is over its fair share (ceil(N / live replicas):
a replica joined) and takes free or expired partitions up to it (a replica left or died).
Owners also reclaim their partitions' orphaned entries (actors/ledger.py). The hash is
producer-writable input: a value that does not parse, or whose expiry is further than one
lease away (replicas of a namespace share a lease), is a free partition, and a producer
that scribbles on it can only move wake-ups around, never lose a job (probes find it). A
`SET` (or any other type) on the hash or the takers' set is no stop either: the claim script
replaces the wrong-typed key and says so, the keeper logs it (rate-limited) and claims again
on the fresh keys (probes still read every partition meanwhile).
"""

import asyncio
import logging
from typing import Callable

from redis.exceptions import ResponseError

from conveyor.actors.base import Actor
from conveyor.actors.partition_scripts import SCRIBBLED_MARK
from conveyor.actors.resilience import keep_subscribed
from conveyor.actors.streams import Streams
from conveyor.clients.log_limits import RateLimitedLog, shown

log = logging.getLogger(__name__)
LISTEN_TIMEOUT_S = 1.0  # how long one wait on the channels lasts before subscriptions are checked


class PartitionKeeper(Actor):
    """Owns ``owned`` (ingest and the ledger read it); calls ``wake(partition)`` for a
    wake-up on an owned partition and for each partition it newly owns."""

    name = "partition-keeper"

    def __init__(self, streams: Streams, lease_ms: int, check_s: float, wake: Callable[[int], None]):
        super().__init__()
        self.streams = streams
        self.lease_ms = lease_ms
        self.check_s = check_s
        self.wake = wake
        self.owned: frozenset[int] = frozenset()
        self.warnings = RateLimitedLog(log)

    async def run(self) -> None:
        await asyncio.gather(self._keep_leases(), self._listen())

    async def release(self) -> None:
        """A clean stop: others take the partitions at their next check, not after a lease."""
        self.owned = frozenset()
        try:
            await self.streams.release_partitions()
        except ResponseError as exc:  # the leases lapse by themselves: a stop is no place to fail
            self.warnings.warning("release", "could not give back the partitions: %s", shown(str(exc), 300))

    async def _keep_leases(self) -> None:
        while not self.stopped:
            owned = await self._claim()
            if owned != self.owned:
                log.info("partitions owned: %s (was %s)", sorted(owned), sorted(self.owned))
                for partition in owned - self.owned:
                    self.wake(partition)  # its backlog is read now, not at the next probe
                self.owned = owned
            await asyncio.sleep(self.check_s)

    async def _claim(self) -> frozenset[int]:
        """The partitions owned after one claim. A scribbled key (replaced by the script) costs
        a warning and one more claim; scribbled again at once: owning none until the next
        check. Any other refusal (e.g. NOPERM: a misconfigured ACL) still stops the replica."""
        for _ in range(2):
            try:
                return frozenset(await self.streams.claim_partitions(self.lease_ms))
            except ResponseError as exc:
                if not str(exc).startswith(SCRIBBLED_MARK):
                    raise
                self.warnings.warning(
                    "scribbled",
                    "partition lease keys were overwritten (a producer's write?): %s; claiming again",
                    shown(str(exc), 300),
                )
        return frozenset()

    async def _listen(self) -> None:
        stopped = lambda: self.stopped  # noqa: E731
        await keep_subscribed(stopped, self.streams.wake_messages, self._follow, "wake channels", self.warnings)

    async def _follow(self, pubsub) -> None:
        """Keep the subscriptions to the owned partitions' channels; wake ingest per message."""
        channels: dict[str, int] = {}
        while not self.stopped:
            wanted = {stream: p for p in self.owned for stream in self.streams.partition_streams(p)}
            gone, new = set(channels) - set(wanted), set(wanted) - set(channels)
            if gone:
                await pubsub.unsubscribe(*gone)
            if new:
                await pubsub.subscribe(*new)
            channels = wanted
            if not channels:
                await asyncio.sleep(LISTEN_TIMEOUT_S)
                continue
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=LISTEN_TIMEOUT_S)
            if isinstance(message, dict) and message.get("type") == "message":
                channel = message.get("channel")
                channel = channel.decode("utf-8", "replace") if isinstance(channel, bytes) else channel
                if channel in channels:
                    self.wake(channels[channel])
