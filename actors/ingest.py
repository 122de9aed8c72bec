"""IngestActor: pulls only as many jobs as the ledger grants it credits and bytes for (a
flood waits in Redis, not in memory), decodes and validates them, and hands them to the
engine-core actor. Entries the ledger reclaimed from a dead replica arrive in its mailbox and are
taken in the same way, also while it waits for a grant.

Entries are untrusted: an entry that cannot be read owns no job and is refused without
touching any job's record; only an entry whose attempt was started speaks for its job."""

import asyncio
import dataclasses
import datetime
import logging
import os
import time
import zlib

from redis.exceptions import ResponseError

from conveyor.actors.base import Actor
from conveyor.actors.config import ReplicaConfig
from conveyor.actors.engine_client import EngineCoreClient
from conveyor.actors.ledger import JobLedger
from conveyor.actors.messages import Delivery, EntryRefused, JobEnded, NewJob, ReadEntry, WantCredits, request_key
from conveyor.actors.resume import MAX_EVENTS as MAX_RESUME_EVENTS
from conveyor.actors.resume import Carried, Resumer
from conveyor.actors.streams import CONFLICT, DUPLICATE, Streams
from conveyor.clients.errors import ProtocolError
from conveyor.clients.log_limits import RateLimitedLog, shown
from conveyor.clients.protocol import JobRequest, decode_job, payload_digest
from conveyor.clients.tool_grammar import forced_call_schema
from conveyor.clients.tool_parsers import ToolReading
from conveyor.clients.tool_schema import choice_mode
from conveyor.engine import InvalidRequest, LoRARequest, SamplingParams
from conveyor.engine.sampling_params import SamplingDefaults

log = logging.getLogger(__name__)
FIRST_IDLE_POLL_S = 0.001  # empty streams: poll again after this, doubling up to the cap
UNREADABLE_STREAM_BACKOFF_S = 1.0


class IngestActor(Actor):
    name = "ingest"
    mailbox_size = 0  # only the ledger sends here, entries it reserved credits for: bounded by them

    def __init__(
        self,
        streams: Streams,
        engine: EngineCoreClient,
        ledger: JobLedger,
        engine_core: Actor,
        publisher: Actor,
        config: ReplicaConfig,
        door: str = "",
    ):
        """``door``: the namespace, on a replica serving several ("" when it serves one)."""
        super().__init__()
        self.door = door
        self.budget = None  # the announcer's BudgetGate where a --token-budget is set
        self.tracer = None  # a JobTracer where OTEL_* asks for traces (actors/tracing.py)
        self.streams = streams
        # its own tokenizer: it tokenizes on a worker thread while the loop detokenizes
        self.inputs = engine.own_input_processor()
        self.ledger = ledger
        self.engine_core = engine_core
        self.publisher = publisher
        self.config = config
        self.warnings = RateLimitedLog(log)
        self.partitions = None  # the PartitionKeeper whose `owned` it reads (None: reads every partition)
        self.num_partitions = streams.keys.partitions
        # partitions to read: woken, or that gave entries last time. None at start: the keeper
        # wakes each partition it comes to own (its backlog is read then), probes find the rest
        self.pending: set[int] = set()
        self.woken = asyncio.Event()
        self.next_probe = zlib.crc32(config.consumer.encode()) % self.num_partitions
        # the adapters a job may name in `lora`: ids in --lora-modules order (the engine's slots and cache keys)
        self.adapters = {
            name: LoRARequest(name, number, path)
            for number, (name, path) in enumerate(config.lora_modules.items(), start=1)
        }
        # what the sampling fields a job leaves unset take: the served model's generation config
        self.sampling_defaults = sampling_defaults_of(engine)
        facts = engine.facts
        self.resumer = Resumer(
            self.inputs.tokenizer, facts.eos_token_ids, facts.vocab_size, streams.model_identity, config.max_resumes
        )
        self.metrics = None  # the replica's ReplicaMetrics: tokens resumed and recomputed

    async def run(self) -> None:
        idle_s = FIRST_IDLE_POLL_S
        while not self.stopped:
            credits, budget = await self._credits()
            entries = await self._read(credits, budget, self._plan())
            # leased from the moment they are read: renewed, never reclaimed from under us
            self.ledger.entries_read(entries)
            for entry in entries:
                await self.accept(entry)
            if entries:
                idle_s = FIRST_IDLE_POLL_S
                continue
            if self.partitions is None:
                await self._idle(idle_s)
            elif not self.pending and not await self._idle(idle_s):
                self.pending.add(self._next_probe())  # no wake-up: probe one partition (steal)
            idle_s = min(2 * idle_s, self.config.read_block_ms / 1000, self.config.idle_poll_max_s)

    def wake(self, partition: int) -> None:
        """A wake-up for ``partition`` (bounded: a set of partition numbers). The partition
        keeper calls it for messages on the owned partitions' channels."""
        if 0 <= partition < self.num_partitions:
            self.pending.add(partition)
            self.woken.set()

    def _plan(self) -> list[int]:
        """The partitions to read now, taken out of ``pending`` (the read puts back those
        that may hold more), the owned ones first."""
        if self.partitions is None:  # no ownership: every partition at every read
            self.pending.update(range(self.num_partitions))
            self._next_probe()  # the first partition rotates, so all are served alike
        owned = self.partitions.owned if self.partitions is not None else frozenset()
        plan = sorted(self.pending, key=lambda p: (p not in owned, (p - self.next_probe) % self.num_partitions))
        self.pending.clear()
        return plan

    def _next_probe(self) -> int:
        """Partitions in turn from a start of this replica's own: every one is probed, and
        replicas probing together start apart."""
        probe, self.next_probe = self.next_probe, (self.next_probe + 1) % self.num_partitions
        return probe

    async def _credits(self) -> tuple[int, int]:
        """The ledger's grant of (entries, bytes) to read, reserved for this read."""
        request = WantCredits()
        await self.ledger.send(request)
        await self._take_reclaimed_until(request.reply)
        return request.reply.result()

    async def _idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a wake-up, taking in reclaimed entries meanwhile.
        True when a partition was woken."""
        self.woken.clear()
        timer = asyncio.ensure_future(asyncio.sleep(seconds))
        wake = asyncio.ensure_future(self.woken.wait())
        either = asyncio.ensure_future(asyncio.wait({timer, wake}, return_when=asyncio.FIRST_COMPLETED))
        try:
            await self._take_reclaimed_until(either)
        finally:
            for future in (timer, wake, either):
                future.cancel()
        return bool(self.pending)

    async def _take_reclaimed_until(self, done: asyncio.Future) -> None:
        """Take in reclaimed entries (the mailbox) until ``done`` is and none is queued:
        never stuck on either, and reclaimed entries never wait behind new ones."""
        while True:
            if not self.mailbox.empty():
                await self.accept(self.mailbox.get_nowait().entry)
                continue
            if done.done():
                return
            mail = asyncio.ensure_future(self.mailbox.get())
            try:
                await asyncio.wait({done, mail}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not mail.done():
                    mail.cancel()  # a cancelled get takes nothing out of the queue
            if mail.done():
                await self.accept(mail.result().entry)

    async def _read(self, credits: int, budget: int, plan: list[int]) -> list[ReadEntry]:
        if not plan:
            return []
        try:
            entries, more = await self.streams.read_partitions(plan, credits, budget)
        except ResponseError as exc:  # e.g. a producer replaced a request stream by another type
            self.warnings.warning("read", "cannot read the request streams: %s", shown(str(exc), 200))
            await asyncio.sleep(UNREADABLE_STREAM_BACKOFF_S)
            return []
        self.pending |= more
        return entries

    async def accept(self, entry: ReadEntry) -> None:
        """One delivered entry (new, or reclaimed from a dead replica). The ledger learns where
        it went: refused (from the publisher, once it is written: its bytes count until then),
        parked or started (``may_start``, ``track``), dropped (``entry_done``)."""
        try:
            job = self._decode(entry)
        except ProtocolError as exc:
            await self._refuse(entry, exc.job_id, exc.code or "invalid_job", exc.message)
            return
        misplaced = self._misplaced(entry, job.job_id)
        if misplaced:
            await self._refuse(entry, job.job_id, "wrong_partition", misplaced)
            return
        if self.ledger.may_start(job.job_id, entry):  # else its job runs here: parked until it ends
            await self._start(entry, job)

    async def _start(self, entry: ReadEntry, job: JobRequest) -> None:
        """Count the attempt on the job's record, then hand the job on."""
        try:
            new_trace = self.tracer.new_trace_id() if self.tracer is not None else ""
            attempt, cancelled = await self.streams.start_attempt(
                job.job_id, entry.entry_id, job.result_ttl, payload_digest(job), job, new_trace
            )
        except ResponseError as exc:  # the job's own keys are unusable (e.g. its hash is a string)
            await self._refuse(
                entry, job.job_id, "bad_job_record", f"the job's record cannot be used: {exc}", notify=False
            )
            return
        if attempt in (DUPLICATE, CONFLICT):
            await self._drop_second_submission(entry, job, attempt == CONFLICT)
            return
        delivery = Delivery(
            entry.stream,
            entry.entry_id,
            job.job_id,
            attempt,
            job.result_ttl,
            job.metadata,
            job.deadline,
            entry.size,
            self._tool_reading(job),
            self.door,
            job.webhook,
            self._begin_spans(entry, job, attempt, new_trace),
        )
        self.ledger.track(delivery)
        # shielded: a stop (SIGTERM's drain) landing while the prompt is tokenized must not
        # leave a started, held job that never reaches the engine (the drain would wait out
        # its grace period for it, then hand it back)
        await asyncio.shield(self._hand_on(entry, job, delivery, cancelled))

    def _begin_spans(self, entry: ReadEntry, job: JobRequest, attempt: int, new_trace: str):
        """The attempt's spans, when this replica traces (``new_trace``: the id its own trace gets)."""
        if self.tracer is None:
            return None
        try:
            return self.tracer.begin(
                job, entry.stream, entry.entry_id, attempt, _enqueue_time(entry.entry_id), new_trace
            )
        except Exception as exc:  # noqa: BLE001 - tracing never stops a job, nor the replica
            self.warnings.warning("tracing", "cannot trace job %s: %s", job.job_id, shown(repr(exc), 200))
            return None

    async def _hand_on(self, entry: ReadEntry, job: JobRequest, delivery: Delivery, cancelled: bool) -> None:
        """A started job to the engine-core actor, or its end (cancelled, too late, invalid) to the publisher."""
        ended = self._reject_reason(job, delivery.attempt, cancelled) or self._over_budget(entry.entry_id)
        if ended is not None:
            await self.publisher.send(
                JobEnded(
                    delivery,
                    *ended[:3],
                    dead_letter_reason=ended[3],
                    raw_fields=entry.fields if ended[1] == "max_deliveries" else None,
                )
            )
            return
        try:
            request = await asyncio.to_thread(self._make_request, job, entry.entry_id)
        except InvalidRequest as exc:
            await self.publisher.send(JobEnded(delivery, "error", "invalid_request", str(exc)))
            return
        if delivery.attempt > 1:  # taken over: continue from what earlier attempts published
            carried = await self._carried(job, delivery, request.prompt_token_ids)
            if carried.token_ids:
                request = dataclasses.replace(request, resumed_token_ids=carried.token_ids, resumed_chars=carried.chars)
                delivery = dataclasses.replace(delivery, resumed=(len(carried.token_ids), carried.chars))
        await self.engine_core.send(NewJob(delivery, job, request))

    async def _carried(self, job: JobRequest, delivery: Delivery, prompt_ids) -> Carried:
        """What a new attempt carries over (actors/resume.py), noted on the job's record."""
        published = await self.streams.published(job.job_id, delivery.attempt, MAX_RESUME_EVENTS)
        if published is None:
            carried = Carried(reason="its out stream is longer than a job's or not a stream")
        else:
            earlier, entries = published
            try:
                carried = await asyncio.to_thread(
                    self.resumer.check, job, list(prompt_ids), delivery.attempt, earlier, entries
                )
            except Exception as exc:  # noqa: BLE001 - a check that fails costs a rerun, never the replica
                self.warnings.warning("resume", "cannot resume job %s: %s", job.job_id, shown(repr(exc), 200))
                carried = Carried(reason=f"the check failed: {type(exc).__name__}")
        if carried.num_published or carried.reason:
            await self.streams.note_resume(job.job_id, delivery.attempt, carried.note())
        if self.metrics is not None:
            self.metrics.record_resume(len(carried.token_ids), carried.num_published - len(carried.token_ids))
        return carried

    def _decode(self, entry: ReadEntry) -> JobRequest:
        if not entry.truncated:
            return decode_job(entry.fields, entry.entry_id)
        message = f"entry is {entry.size} bytes, limit {self.streams.max_entry_bytes}"
        raise ProtocolError(message, code="too_large", job_id=_salvaged_job_id(entry.fields))

    def _misplaced(self, entry: ReadEntry, job_id: str) -> str | None:
        """Why a job's entry is on another partition's stream than its own, else None: its
        record lives in its own partition's slot, which one script cannot touch with this stream's."""
        keys = self.streams.keys
        own, here = keys.partition_of(job_id), keys.partition_of_stream(entry.stream)
        if own == here:
            return None
        return (
            f"job_id {job_id!r} belongs to partition {own} of {keys.partitions} (crc32(job_id) % partitions), "
            f"but the entry is on partition {here}'s stream; add it to {keys.job_request_stream(job_id, 'batch')} "
            f"or its interactive / model sibling"
        )

    async def _refuse(self, entry: ReadEntry, job_id: str | None, code: str, message: str, notify: bool = True) -> None:
        self.warnings.warning(
            "refused", "refused entry %s of %s: %s: %s", entry.entry_id, entry.stream, code, shown(message, 200)
        )
        await self.publisher.send(
            EntryRefused(
                entry.stream, entry.entry_id, job_id, code, message, entry.fields, entry.size, entry.truncated, notify
            )
        )

    async def _drop_second_submission(self, entry: ReadEntry, job: JobRequest, conflict: bool) -> None:
        """Another entry for a job that already has one: the job's own record is left alone."""
        if conflict:
            message = f"job_id {job.job_id!r} reused with a different payload"
            await self.publisher.send(
                EntryRefused(
                    entry.stream,
                    entry.entry_id,
                    job.job_id,
                    "conflict",
                    message,
                    entry.fields,
                    entry.size,
                    notify=False,
                )
            )
            return
        await self.streams.drop_entry(entry.stream, entry.entry_id)
        self.ledger.entry_done(entry.stream, entry.entry_id)

    def _reject_reason(self, job: JobRequest, attempt: int, cancelled: bool):
        """(event type, code, message, dead-letter reason) for a job that must not run."""
        if attempt > self.config.max_deliveries:
            reason = f"delivered {attempt} times (max_deliveries={self.config.max_deliveries})"
            return ("error", "max_deliveries", reason, reason)
        if cancelled:
            return ("cancelled", "", "", None)
        if job.deadline is not None and job.deadline <= time.time():
            return ("error", "deadline_exceeded", "the job's deadline passed before it started", None)
        cap = self.config.max_tokens_cap
        if cap is not None and "max_tokens" in job.model_fields_set and job.max_tokens > cap:  # a default: capped
            return (
                "error",
                "invalid_request",
                f"max_tokens: {job.max_tokens} is over this replica's limit of {cap} (max_tokens_cap)",
                None,
            )
        return None

    def _over_budget(self, entry_id: str):
        """The refusal of an entry queued since the namespace's daily token budget was spent
        (however it got past the submit script), else None."""
        gate = self.budget
        if gate is None or not gate.refuses(_enqueue_time(entry_id), time.time()):
            return None
        resets = datetime.datetime.fromtimestamp(gate.resets_at, datetime.timezone.utc).isoformat()
        message = (
            f"the namespace's daily token budget ({gate.budget} tokens, token_budget) is spent; it resets at {resets}"
        )
        return ("error", "insufficient_quota", message, None)

    def _tool_reading(self, job: JobRequest) -> ToolReading | None:
        mode = choice_mode(job.tool_choice)
        if not job.tools or mode == "none":
            return None
        names = (job.tool_choice.function.name,) if mode == "named" else tuple(t.function.name for t in job.tools)
        return ToolReading(mode, self.config.tool_call_parser or self.inputs.tool_parser(), names, job.job_id)

    def _make_request(self, job: JobRequest, entry_id: str):
        params = self._sampling_params(job)
        tools = job.tools_given()
        forced = tools and forced_call_schema(job.tools, job.tool_choice, job.parallel_tool_calls)
        if forced:  # the grammar that makes the call valid (the job cannot also give one)
            params["structured_outputs"] = forced
        prompt, messages = job.prompt or job.prompt_token_ids, job.chat_messages()
        if job.chat_template == "auto" and self.inputs.has_chat_template():
            prompt, messages = None, [{"role": "user", "content": job.prompt}]
        request = self.inputs.request_for(
            request_key(self.door, job.job_id),
            prompt,
            SamplingParams(**params),
            job.priority_class,
            job.priority,
            _enqueue_time(entry_id),
            messages,
            tools and tools["tools"],
        )
        request = dataclasses.replace(
            request,
            lora_request=self._adapter(job.lora),
            cache_salt=namespace_salt(self.config.namespace, job.cache_salt),
            tenant=self.config.namespace,  # its fair share (engine/fair_share.py), as its prefix cache
        )
        cap, num_prompt_tokens = self.config.max_prompt_tokens, len(request.prompt_token_ids)
        if cap is not None and num_prompt_tokens > cap:
            raise InvalidRequest(
                "prompt", f"{num_prompt_tokens} tokens is over this replica's limit of {cap} (max_prompt_tokens)"
            )
        return request

    def _sampling_params(self, job: JobRequest) -> dict:
        """The job's sampling parameters, the model's defaults in the fields it left unset
        (protocol.MODEL_DEFAULT_FIELDS); the operator's max_tokens_cap bounds a default max_tokens."""
        params = self.sampling_defaults.fill(job.sampling_params(), given=job.model_fields_set)
        cap = self.config.max_tokens_cap
        if "max_tokens" not in job.model_fields_set and cap is not None:
            params["max_tokens"] = min(params["max_tokens"], cap)
        return params

    def _adapter(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        if name not in self.adapters:
            served = ", ".join(self.adapters) or "none"
            raise InvalidRequest("lora", f"this replica serves no adapter {name!r} (served: {served})")
        return self.adapters[name]


def sampling_defaults_of(engine: EngineCoreClient) -> SamplingDefaults:
    """The served model's sampling defaults: those `conveyor serve` found for its engine
    (``engine.sampling_defaults``, its --generation-config), else the model's own
    generation_config.json (--generation-config auto, or $CONVEYOR_GENERATION_CONFIG)."""
    known = getattr(engine, "sampling_defaults", None)
    if known is not None:
        return known
    from conveyor.engine.models.loader import sampling_defaults

    return sampling_defaults(engine.facts.model_name, os.environ.get("CONVEYOR_GENERATION_CONFIG", "auto"))


def _salvaged_job_id(stub_fields: dict) -> str | None:
    """The job id of an oversized entry, when its kept prefix still shows it."""
    try:
        decode_job(stub_fields)
    except ProtocolError as exc:
        return exc.job_id
    return None


def _enqueue_time(entry_id: str) -> float:
    """Stream ids start with the server's milliseconds: queue time counts from XADD."""
    try:
        return int(entry_id.split("-")[0]) / 1000
    except ValueError:
        return time.time()


def namespace_salt(namespace: str, salt: str | None) -> str:
    """A job's prefix-cache salt: its namespace's name, then its own salt (lengths first, so
    no two (namespace, salt) pairs give the same text): namespaces never share a block."""
    own = salt or ""
    return f"{len(namespace)}:{namespace}{len(own)}:{own}"
