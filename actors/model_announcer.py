"""ModelAnnouncer: publishes what light clients need about the served model (name, context,
EOS, chat template, tokenizer) under ``<ns>:model:<name>``, and the operator's queue bound
under ``<ns>:limits`` (the submit script enforces it), at start and periodically (both have
a TTL, so what nobody serves any more disappears). Every REPLICA_BEAT_S it also writes this
replica's record for operators (clients/replica_records.py: state, running and waiting
sequences, KV use, tokens/s), a fixed set of small fields."""

import asyncio
import dataclasses
import datetime
import logging
import time

from redis.exceptions import ResponseError

from conveyor.actors.base import Actor
from conveyor.actors.metrics import ReplicaMetrics
from conveyor.actors.resilience import CONNECTION_ERRORS
from conveyor.actors.streams import Streams
from conveyor.clients.log_limits import RateLimitedLog, shown
from conveyor.clients.model_info import MODEL_INFO_REPUBLISH_S, ModelInfo
from conveyor.clients.replica_records import REPLICA_BEAT_S, record_fields
from conveyor.clients.usage import next_day_start, read_usage_async, usage_day
from conveyor.engine.engine_core import CoreFacts

MODEL_INFO_TTL_S = 3600
log = logging.getLogger(__name__)


class BudgetGate:
    """Whether the namespace's daily token budget is spent, since when, until when: intake
    refuses entries queued since it was seen spent (jobs queued before still run)."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.spent_since: float | None = None  # epoch seconds this replica first saw it spent
        self.resets_at = 0  # epoch seconds (next midnight UTC) while spent, else 0

    def update(self, spent: bool, now: float, midnight: int) -> None:
        if not spent:
            self.spent_since, self.resets_at = None, 0
        elif self.spent_since is None or now >= self.resets_at:
            self.spent_since, self.resets_at = now, midnight

    def refuses(self, queued_at: float, now: float) -> bool:
        return self.spent_since is not None and queued_at >= self.spent_since and now < self.resets_at


class ModelAnnouncer(Actor):
    name = "model-announcer"

    def __init__(
        self,
        streams: Streams,
        facts: CoreFacts,
        tokenizer,
        model_name: str,
        max_queue_len: int | None = None,
        max_tokens_cap: int | None = None,
        lora_adapters: tuple[str, ...] = (),
        metrics: ReplicaMetrics | None = None,
        token_budget: int | None = None,
    ):
        super().__init__()
        self.streams = streams
        self.metrics = metrics or ReplicaMetrics()
        self.max_num_seqs = facts.max_num_seqs
        self.state = "serving"  # the replica sets draining; farewell() writes stopped
        self.started_at = time.time()
        self._last_beat = (time.monotonic(), 0)  # when, and the generated tokens then
        # what producers should know of the operator's limits (the submit script and the gateway read them)
        self.limits = {
            name: value
            for name, value in (("max_queue_len", max_queue_len), ("max_tokens_cap", max_tokens_cap))
            if value
        }
        self.info = ModelInfo.from_hf_tokenizer(
            name=model_name,
            max_model_len=min(facts.max_model_len, facts.max_pool_tokens),
            eos_token_ids=facts.eos_token_ids,
            tokenizer=tokenizer,
        )
        self.info = dataclasses.replace(self.info, lora_adapters=tuple(lora_adapters))
        self.token_budget = token_budget
        self.budget = BudgetGate(token_budget)  # intake reads it

    async def run(self) -> None:
        warnings = RateLimitedLog(log)
        published = float("-inf")
        while not self.stopped:
            if time.monotonic() - published >= MODEL_INFO_REPUBLISH_S:
                await self._publish_model(warnings)
                published = time.monotonic()
            await self.streams.publish_replica_record(self.record(), time.time())
            if self.token_budget:
                await self._publish_budget(warnings)
            await asyncio.sleep(REPLICA_BEAT_S)

    async def farewell(self, timeout_s: float = 2.0) -> None:
        """A last record saying `stopped` (bounded: Redis may be gone by now)."""
        self.state = "stopped"
        try:
            await asyncio.wait_for(self.streams.publish_replica_record(self.record(), time.time()), timeout_s)
        except (asyncio.TimeoutError, OSError, ResponseError):
            log.info("could not write the stopped replica record")

    async def _publish_model(self, warnings: RateLimitedLog) -> None:
        try:
            await self.streams.publish_model_info(self.info, MODEL_INFO_TTL_S)
        except ResponseError as exc:  # e.g. a producer replaced <ns>:models by another type
            warnings.warning("publish", "cannot publish the model info: %s", shown(str(exc), 200))
        if self.limits:
            await self.streams.publish_limits(self.limits, MODEL_INFO_TTL_S)

    async def _publish_budget(self, warnings: RateLimitedLog) -> None:
        """The daily token budget and, once today's usage reached it, when submits may resume
        (next midnight UTC): the submit script refuses jobs until then, and so does intake for
        entries queued since (``budget``: a producer can write the limits hash or XADD
        directly). The limits are written when that changes and, while spent, every beat; the
        model info's republishing refreshes them otherwise. A beat that cannot read the usage
        changes nothing (Redis away: retried next beat)."""
        now = time.time()
        today = datetime.date.fromisoformat(usage_day(now))
        try:
            rows, skipped = await read_usage_async(self.streams.redis, self.streams.keys, today, today)
        except (ResponseError, *CONNECTION_ERRORS) as exc:
            warnings.warning("budget", "cannot read today's usage: %s", shown(str(exc), 200))
            return
        if skipped:
            warnings.warning("budget-keys", "usage keys skipped as unreadable (ACL? scribbled?): %s", skipped[:3])
        spent = sum(row.prompt_tokens + row.completion_tokens for row in rows)
        self.budget.update(spent >= self.token_budget, now, int(next_day_start(now).timestamp()))
        budget = {"token_budget": self.token_budget, "budget_reset_at": self.budget.resets_at}
        changed = any(self.limits.get(name) != value for name, value in budget.items())
        if changed or self.budget.resets_at:  # while spent, every beat: a producer may have cleared it
            self.limits.update(budget)
            await self.streams.publish_limits(self.limits, MODEL_INFO_TTL_S)

    def record(self) -> dict[str, str]:
        stats, now = self.metrics.latest_stats, time.monotonic()
        generated = self.metrics.generated_tokens_total
        before, tokens_before = self._last_beat
        self._last_beat = (now, generated)
        return record_fields(
            model=self.info.name,
            state=self.state,
            started_at=round(self.started_at, 3),
            seen_at=round(time.time(), 3),
            running=stats.get("num_running", 0),
            waiting=stats.get("num_waiting", 0),
            max_num_seqs=self.max_num_seqs,
            kv_usage=round(float(stats.get("kv_usage", 0.0)), 4),
            tokens_per_s=round((generated - tokens_before) / max(now - before, 1e-3), 1),
            generated_tokens=generated,
            finished=self.metrics.finished_total,
        )
