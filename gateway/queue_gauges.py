"""The queue's gauges on the gateway's `/metrics`, for dashboards and autoscalers (KEDA's
Prometheus scaler, an HPA on an external metric): docs/dashboard.md lists them. Each scrape
reads every configured namespace once (QueueWatch: reused for MAX_AGE_S), so its Redis cost
is bounded by namespaces, partitions and models, never by the jobs queued. A gauge whose fact
is None (the deadline's, when no waiting job has one) has no sample for that stream."""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from conveyor.clients.queue_metrics import DEADLINE_SCAN_ENTRIES, NamespaceFacts

STREAM_LABELS = ["namespace", "model", "priority_class", "partition"]
STREAM_GAUGES = (
    ("conveyor_queue_length", "Entries in the request stream (waiting + in flight)", "length"),
    (
        "conveyor_queue_pending",
        "Entries delivered to a replica and not yet finished (the engines group's PEL)",
        "pending",
    ),
    ("conveyor_queue_lag", "Entries not yet delivered to any replica (waiting)", "lag"),
    ("conveyor_queue_oldest_age_seconds", "Age of the oldest waiting entry (0: none waits)", "oldest_age_s"),
    ("conveyor_queue_consumers", "Consumers (replicas, live or not) of the engines group", "consumers"),
    (
        "conveyor_queue_deadline_seconds",
        f"Seconds until the nearest deadline among the {DEADLINE_SCAN_ENTRIES} oldest waiting jobs, negative"
        " once it passed; absent when none of them has a deadline",
        "deadline_in_s",
    ),
)


class QueueCollector(Collector):
    """Renders the facts the /metrics route read just before (`update`)."""

    def __init__(self) -> None:
        self.facts: list[NamespaceFacts] = []

    def update(self, facts: list[NamespaceFacts]) -> None:
        self.facts = facts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = {name: GaugeMetricFamily(name, doc, labels=STREAM_LABELS) for name, doc, _ in STREAM_GAUGES}
        dead = GaugeMetricFamily("conveyor_dead_letters", "Entries in the dead-letter stream", labels=["namespace"])
        replicas = GaugeMetricFamily(
            "conveyor_replicas_live", "Replicas whose record is fresh, by model", labels=["namespace", "model"]
        )
        now = time.time()
        for facts in self.facts:
            for stream in facts.streams:
                labels = [facts.namespace, stream.model[:200], stream.priority_class, str(stream.partition)]
                for name, _, attribute in STREAM_GAUGES:
                    value = getattr(stream, attribute)
                    if value is not None:  # the deadline's: no waiting job has one, no sample
                        families[name].add_metric(labels, value)
            dead.add_metric([facts.namespace], facts.dead_letters)
            live: dict[str, int] = {}
            for record in facts.replicas:
                if record.live(now):
                    model = record.fields.get("model", "")[:200]
                    live[model] = live.get(model, 0) + 1
            for model, count in sorted(live.items()):
                replicas.add_metric([facts.namespace, model], count)
        yield from families.values()
        yield dead
        yield replicas
