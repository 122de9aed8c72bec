"""What the gateway knows of each namespace's queue: the last read of its facts
(clients/queue_metrics.py), shared by the dashboard's pollers and `/metrics` (one read per
namespace per MAX_AGE_S however many ask), and a bounded ring of samples for the dashboard's
throughput chart. Namespaces come only from the configured keys: the cache is bounded."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from conveyor.clients.keys import Keys
from conveyor.clients.queue_metrics import NamespaceFacts, read_namespace_facts

MAX_AGE_S = 1.0  # a read younger than this is reused
SAMPLE_EVERY_S = 2.0
SAMPLES = 300  # 10 minutes at SAMPLE_EVERY_S
RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic
    delivered: dict[
        tuple[str, str, int], tuple[int | None, int]
    ]  # (model, class, partition) -> (entries read, pending)
    tokens_per_s: float  # the live replicas' sum


class QueueWatch:
    """One namespace: the latest facts and the samples taken from them."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.facts: NamespaceFacts | None = None
        self.read_at = float("-inf")
        self.samples: deque[Sample] = deque(maxlen=SAMPLES)
        self._reading = asyncio.Lock()

    async def latest(self) -> NamespaceFacts:
        async with self._reading:
            if time.monotonic() - self.read_at > MAX_AGE_S or self.facts is None:
                self.facts = await read_namespace_facts(self.redis, self.keys)
                self.read_at = time.monotonic()
                self._sample(self.facts)
        return self.facts

    def _sample(self, facts: NamespaceFacts) -> None:
        if self.samples and self.read_at - self.samples[-1].at < SAMPLE_EVERY_S:
            return
        delivered = {(s.model, s.priority_class, s.partition): (s.entries_read, s.pending) for s in facts.streams}
        now = time.time()
        tokens = sum(r.number("tokens_per_s") or 0.0 for r in facts.replicas if r.live(now))
        self.samples.append(Sample(self.read_at, delivered, tokens))

    def done_per_s(self, window_s: float = RATE_WINDOW_S) -> dict[tuple[str, str, int], float]:
        """Jobs that left each stream per second over the last `window_s`: entries delivered
        minus the growth of those in flight (acked entries are finished or dead-lettered)."""
        if len(self.samples) < 2:
            return {}
        last, rates = self.samples[-1], {}
        for where in last.delivered:  # from the stream's first counted sample in the window: it may be new
            first = next((s for s in self.samples if last.at - s.at <= window_s and _counted(s, where)), last)
            if (rate := _rate(first, last, where)) is not None:
                rates[where] = rate
        return rates

    def series(self) -> dict[str, list[float]]:
        """The chart's points: seconds ago, jobs done per second, tokens per second."""
        points = list(self.samples)
        ago, done, tokens = [], [], []
        for before, after in zip(points, points[1:]):
            rates = [r for where in after.delivered if (r := _rate(before, after, where)) is not None]
            ago.append(round(points[-1].at - after.at, 1))
            done.append(round(sum(rates), 2))
            tokens.append(round(after.tokens_per_s, 1))
        return {"seconds_ago": ago, "done_per_s": done, "tokens_per_s": tokens}


def _counted(sample: Sample, where: tuple[str, str, int]) -> bool:
    """The stream was there and its group's entries-read known (None until the group first reads)."""
    return where in sample.delivered and sample.delivered[where][0] is not None


def _rate(before: Sample, after: Sample, where: tuple[str, str, int]) -> float | None:
    if where not in before.delivered or after.at <= before.at:
        return None
    (read_0, pending_0), (read_1, pending_1) = before.delivered[where], after.delivered[where]
    if read_0 is None or read_1 is None:
        return None
    return max(0.0, ((read_1 - read_0) - (pending_1 - pending_0)) / (after.at - before.at))


class QueueWatches:
    """A QueueWatch per namespace, made on first use."""

    def __init__(self, redis: Any, keys_of: Any) -> None:
        self.redis, self.keys_of = redis, keys_of
        self._watches: dict[str, QueueWatch] = {}

    def of(self, namespace: str) -> QueueWatch:
        if namespace not in self._watches:
            self._watches[namespace] = QueueWatch(self.redis, self.keys_of(namespace))
        return self._watches[namespace]
