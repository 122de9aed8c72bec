"""Asyncio client with the same API as clients.client (methods are coroutines)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable

import redis.asyncio as aioredis
from tqdm import tqdm

from clients.event_reader import (
    READ_COUNT,
    Deadline,
    EventReader,
    JobResult,
    JobStatus,
    entries_of,
    outcome,
    status_from_hash,
    terminal_from_hash,
)
from clients.events import Event, TerminalEvent, TokenEvent
from clients.connection import RedisSettings, client_settings
from clients.keys import PRIORITY_CLASSES, Keys, default_namespace
from clients.queue_status import model_names, queue_status_commands, queue_status_from
from clients.submission import (
    CANCEL_LUA,
    ENQUEUED,
    SUBMIT_CHUNK,
    SUBMIT_LUA,
    build_job,
    build_jobs,
    cancel_args,
    check_chunk,
    check_submitted,
    submit_args,
)


class AsyncClient:
    """Async producer/consumer handle on one namespace; connects like clients.client.Client
    (`redis_url`, or `connection=RedisSettings(...)`); `redis_client` needs decode_responses=False."""

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        connection: RedisSettings | None = None,
        redis_client: aioredis.Redis | None = None,
    ) -> None:
        self._owns_redis = redis_client is None
        self.redis = redis_client or client_settings(redis_url, connection).async_client()
        self.keys = Keys(namespace or default_namespace())
        self._submit_script = self.redis.register_script(SUBMIT_LUA)
        self._cancel_script = self.redis.register_script(CANCEL_LUA)

    async def submit(self, prompt: str | None = None, *, max_queue_len: int | None = None, **fields: Any) -> AsyncJob:
        job = build_job({"prompt": prompt, **fields})
        keys, args = submit_args(self.keys, job, max_queue_len)
        code = await self._submit_script(keys, args)
        check_submitted(code, job, self.keys, max_queue_len)
        return AsyncJob(self, job.job_id, enqueued=code == ENQUEUED)

    async def submit_many(
        self,
        items: Iterable[dict[str, Any]],
        *,
        progress: bool = True,
        max_queue_len: int | None = None,
    ) -> list[AsyncJob]:
        requests = build_jobs(items)
        jobs: list[AsyncJob] = []
        with tqdm(total=len(requests), disable=not progress, unit="job", desc="submit") as bar:
            for start in range(0, len(requests), SUBMIT_CHUNK):
                chunk = requests[start : start + SUBMIT_CHUNK]
                await self._submit_chunk(chunk, max_queue_len, jobs)
                bar.update(len(chunk))
        return jobs

    async def _submit_chunk(self, chunk: list, max_queue_len: int | None, jobs: list[AsyncJob]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for job in chunk:
            await self._submit_script(*submit_args(self.keys, job, max_queue_len), client=pipe)
        codes = await pipe.execute()
        jobs.extend(AsyncJob(self, job.job_id, enqueued=code == ENQUEUED) for job, code in zip(chunk, codes)
                    if code >= 0)  # fmt: skip
        check_chunk(codes, chunk, self.keys, max_queue_len, jobs)

    def job(self, job_id: str, entry_id: str | None = None) -> AsyncJob:
        return AsyncJob(self, job_id, entry_id=entry_id)

    async def queue_status(self) -> dict[str, Any]:
        streams = [k for c in PRIORITY_CLASSES async for k in self.redis.scan_iter(
            match=self.keys.model_requests_pattern(c), _type="STREAM")]  # fmt: skip
        models = model_names(self.keys, await self.redis.smembers(self.keys.models), streams)
        pipe = self.redis.pipeline(transaction=False)
        queue_status_commands(pipe, self.keys, models)
        return queue_status_from(self.keys, models, await pipe.execute(raise_on_error=False))

    async def close(self) -> None:
        if self._owns_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncJob:
    """Async handle on one submitted job; same semantics as clients.client.Job."""

    def __init__(self, client: AsyncClient, job_id: str, enqueued: bool | None = None, entry_id: str | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.enqueued = enqueued
        self.entry_id = entry_id  # the request entry (raw XADD reply): refusals of others are skipped
        self._terminal: TerminalEvent | None = None

    def __repr__(self) -> str:
        return f"AsyncJob({self.job_id!r})"

    async def stream(self, from_id: str = "0-0", timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        async for event in self.events(from_id, timeout):
            if event.is_terminal:
                self._terminal = event
                outcome(self.job_id, event)
                return
            yield event

    async def events(
        self, from_id: str = "0-0", timeout: float | None = None, *, idle: bool = True
    ) -> AsyncIterator[Event]:
        reader, deadline = EventReader(from_id, self.entry_id), Deadline(timeout)
        out_key = self.client.keys.out(self.job_id)
        while True:
            reply = await self.client.redis.xread(
                {out_key: reader.last_id}, count=READ_COUNT, block=deadline.block_ms()
            )
            events = reader.feed(entries_of(reply))
            if not events:
                deadline.raise_if_expired(self.job_id, "event")
                continue
            if idle:
                deadline.restart()
            for event in events:
                yield event
            if events[-1].is_terminal:
                return

    async def result(self, timeout: float | None = None) -> JobResult:
        if self._terminal is None:
            self._terminal = await self._stored_terminal() or await self._await_terminal(timeout)
        return outcome(self.job_id, self._terminal)

    async def _stored_terminal(self) -> TerminalEvent | None:
        return terminal_from_hash(await self.client.redis.hgetall(self.client.keys.job(self.job_id)))

    async def _await_terminal(self, timeout: float | None) -> TerminalEvent:
        async for event in self.events(timeout=timeout, idle=False):
            if event.is_terminal:
                return event
        raise AssertionError("events() ended without a terminal event")

    async def cancel(self) -> bool:
        keys, args = cancel_args(self.client.keys, self.job_id)
        return bool(await self.client._cancel_script(keys, args))

    async def status(self) -> JobStatus:
        return status_from_hash(self.job_id, await self.client.redis.hgetall(self.client.keys.job(self.job_id)))
