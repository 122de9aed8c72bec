"""Prometheus metrics of one replica, with the field's usual names (vLLM's, prefixed
``conveyor_``). The engine-core actor records them after every step; an HTTP endpoint
serves them when ``--metrics-port`` is set."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from conveyor.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ReplicaMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        gauge = lambda name, doc: Gauge(f"conveyor_{name}", doc, registry=self.registry)  # noqa: E731
        counter = lambda name, doc: Counter(f"conveyor_{name}", doc, registry=self.registry)  # noqa: E731
        histogram = lambda name, doc: Histogram(  # noqa: E731
            f"conveyor_{name}", doc, buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the scheduler")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.kv_fragmentation = gauge("kv_cache_fragmentation_perc", "Allocated-but-unused KV slots / allocated slots")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache")
        self.preemptions = gauge("num_preemptions", "Preemptions since start")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.finished = counter("requests_finished", "Finished requests")
        self.resumed_tokens = counter(
            "resumed_tokens",
            "Output tokens taken-over jobs carried over from their earlier attempts (not computed again)",
        )
        self.recomputed_tokens = counter(
            "recomputed_tokens", "Output tokens earlier attempts published that taken-over jobs compute again (reruns)"
        )
        # per namespace (tenant) and model: what `conveyor usage` bills, as it happens
        self.tenant_tokens = Counter(
            "conveyor_tenant_tokens",
            "Tokens of done jobs by namespace, model and kind (prompt, completion, cached)",
            ("namespace", "model", "kind"),
            registry=self.registry,
        )
        self.tenant_jobs = Counter(
            "conveyor_tenant_jobs", "Done jobs by namespace and model", ("namespace", "model"), registry=self.registry
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's consecutive steps")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = histogram("request_queue_time_seconds", "Enqueue to first scheduled")
        # speculative decoding (zeros without it): counters follow the engine's cumulative counts
        self.spec_counters = {
            key: counter(key, doc)
            for key, doc in (
                ("spec_decode_num_drafts", "Sequence-steps that verified draft tokens"),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified"),
                ("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted"),
            )
        }
        self.spec_acceptance = gauge("spec_decode_acceptance_rate", "Accepted / drafted tokens since start")
        self._spec_counts = dict.fromkeys(self.spec_counters, 0)
        self._last_token_time: dict[str, float] = {}
        # what the announcer's replica record reports (plain numbers: no registry reads)
        self.latest_stats: dict = {}
        self.generated_tokens_total = 0
        self.finished_total = 0

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def record_step(self, stats: dict, outputs: list[RequestOutput]) -> None:
        self.latest_stats = stats
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_usage"])
        self.kv_fragmentation.set(stats["kv_fragmentation"])
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        self.preemptions.set(stats["num_preemptions"])
        self._record_speculation(stats)
        now = time.time()
        for output in outputs:
            self._record_tokens(output, now)
            if output.finished:
                self._record_finish(output)

    def record_resume(self, carried: int, recomputed: int) -> None:
        """A taken-over job's start: tokens it carries over, and published ones it computes again."""
        self.resumed_tokens.inc(carried)
        self.recomputed_tokens.inc(recomputed)

    def record_usage(self, namespace: str, model: str, usage) -> None:
        """A done job's usage (clients/events.py Usage)."""
        self.tenant_jobs.labels(namespace, model).inc()
        for kind, count in (
            ("prompt", usage.prompt_tokens),
            ("completion", usage.completion_tokens),
            ("cached", usage.cached_tokens),
        ):
            self.tenant_tokens.labels(namespace, model, kind).inc(count)

    def _record_speculation(self, stats: dict) -> None:
        for key, counter in self.spec_counters.items():
            value = stats.get(key, 0)
            counter.inc(value - self._spec_counts[key])
            self._spec_counts[key] = value
        self.spec_acceptance.set(stats.get("spec_decode_acceptance_rate", 0.0))

    def _record_tokens(self, output: RequestOutput, now: float) -> None:
        num_new = output.num_new_tokens  # all of an n > 1 request's outputs
        if not num_new:
            return
        self.generation_tokens.inc(num_new)
        self.generated_tokens_total += num_new
        last = self._last_token_time.get(output.request_id)
        if last is not None:
            self.itl.observe((now - last) / max(len(o.new_token_ids) for o in output.outputs))
        self._last_token_time[output.request_id] = now

    def _record_finish(self, output: RequestOutput) -> None:
        self._last_token_time.pop(output.request_id, None)
        self.finished.inc()
        self.finished_total += 1
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        metrics = output.metrics
        if metrics is None:
            return
        for histogram, value in ((self.ttft, metrics.ttft), (self.e2e, metrics.e2e), (self.queue, metrics.queue_time)):
            if value is not None:
                histogram.observe(value)
