"""Asyncio client with the same API as clients.client (methods are coroutines).

An awaiting driver of clients.client_core, the programs the sync client drives too."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Iterable

import redis.asyncio as aioredis

from conveyor.clients import client_core as core
from conveyor.clients.connection import RedisSettings
from conveyor.clients.event_reader import JobResult, JobStatus
from conveyor.clients.events import Event, TokenEvent
from conveyor.clients.redis_cluster import queue_script


class AsyncClient(core.ClientState):
    """Async producer/consumer handle on one namespace; connects like clients.client.Client
    (`redis_url`, or `connection=RedisSettings(...)`); `redis_client` needs decode_responses=False."""

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        connection: RedisSettings | None = None,
        redis_client: aioredis.Redis | None = None,
        partitions: int | None = None,
    ) -> None:
        connected, partitions = core.connect(redis_url, connection, redis_client, partitions, asynchronous=True)
        super().__init__(connected, namespace, owns_redis=redis_client is None, partitions=partitions)

    async def submit(self, prompt: str | None = None, *, max_queue_len: int | None = None, **fields: Any) -> AsyncJob:
        return await self._run(core.submit(self.keys, {"prompt": prompt, **fields}, max_queue_len, self._new_job))

    async def submit_many(
        self,
        items: Iterable[dict[str, Any]],
        *,
        progress: bool = True,
        max_queue_len: int | None = None,
    ) -> list[AsyncJob]:
        return await self._run(core.submit_many(self.keys, items, progress, max_queue_len, self._new_job))

    def job(self, job_id: str, entry_id: str | None = None) -> AsyncJob:
        return AsyncJob(self, job_id, entry_id=entry_id)

    async def queue_status(self) -> dict[str, Any]:
        return await self._run(core.queue_status(self.keys))

    async def close(self) -> None:
        if self._owns_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _new_job(self, job_id: str, enqueued: bool) -> AsyncJob:
        return AsyncJob(self, job_id, enqueued=enqueued)

    async def _run(self, program: core.Program) -> Any:
        run = core.Run(program)
        async for _ in self._drive(run):
            raise AssertionError("a program that emits, run for its result")
        return run.result

    async def _drive(self, run: core.Run) -> AsyncIterator[Any]:
        """Perform each I/O step of `run`, yielding what it emits."""
        for step in run:
            if isinstance(step, core.Emit):
                yield step.value
                continue
            try:
                run.reply(await self._perform(step))
            except BaseException as exc:  # raised where the program made the call
                run.fail(exc)

    async def _perform(self, step: core.Step) -> Any:
        if isinstance(step, core.Pipelined):
            pipe = self.redis.pipeline(transaction=False)
            for queued in step.steps:
                await self._queue(queued, pipe)
            return await pipe.execute(raise_on_error=step.raise_on_error)
        if isinstance(step, core.Scan):
            return [key async for key in self.redis.scan_iter(match=step.match, _type=step.type)]
        if isinstance(step, core.Script):
            return await self._script(step)(step.keys, step.args)
        return await getattr(self.redis, step.method)(*step.args, **step.kwargs)

    async def _queue(self, step: core.Call | core.Script, pipe: Any) -> None:
        if isinstance(step, core.Script):
            await queue_script(self._script(step), step.keys, step.args, pipe)
        else:
            getattr(pipe, step.method)(*step.args, **step.kwargs)  # queued, nothing to await


class AsyncJob(core.JobState):
    """Async handle on one submitted job; same semantics as clients.client.Job."""

    client: AsyncClient

    async def stream(self, from_id: str = "0-0", timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        async with aclosing(self.client._drive(core.Run(core.stream(self, from_id, timeout)))) as events:
            async for event in events:
                yield event

    async def events(
        self, from_id: str = "0-0", timeout: float | None = None, *, idle: bool = True
    ) -> AsyncIterator[Event]:
        async with aclosing(self.client._drive(core.Run(core.events(self, from_id, timeout, idle)))) as events:
            async for event in events:
                yield event

    async def result(self, timeout: float | None = None) -> JobResult:
        return await self.client._run(core.result(self, timeout))

    async def cancel(self) -> bool:
        return await self.client._run(core.cancel(self))

    async def status(self) -> JobStatus:
        return await self.client._run(core.status(self))
