"""Synchronous client: submit jobs, stream their tokens, wait for results, cancel.

A blocking driver of clients.client_core, which makes every decision (the async client
drives the same programs)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import redis

from conveyor.clients import client_core as core
from conveyor.clients.connection import RedisSettings
from conveyor.clients.event_reader import JobResult, JobStatus
from conveyor.clients.events import Event, TokenEvent
from conveyor.clients.redis_cluster import queue_script_sync


class Client(core.ClientState):
    """Producer/consumer handle on one Conveyor namespace.

    Connects to `redis_url` (credentials and TLS from the environment, see
    clients/connection.py), or with `connection` (RedisSettings: password, ACL user, TLS
    files), or through `redis_client`, which must use `decode_responses=False`.
    A cluster connection (`RedisSettings(cluster=True)`, a `RedisCluster` client) uses the
    cluster key layout with `partitions` request streams per class (clients/keys.py).
    """

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        connection: RedisSettings | None = None,
        redis_client: redis.Redis | None = None,
        partitions: int | None = None,
    ) -> None:
        connected, partitions = core.connect(redis_url, connection, redis_client, partitions, asynchronous=False)
        super().__init__(connected, namespace, owns_redis=redis_client is None, partitions=partitions)

    def submit(self, prompt: str | None = None, *, max_queue_len: int | None = None, **fields: Any) -> Job:
        """Validate, then enqueue one job (idempotent per job_id). See JobRequest for fields."""
        return self._run(core.submit(self.keys, {"prompt": prompt, **fields}, max_queue_len, self._new_job))

    def submit_many(
        self,
        items: Iterable[dict[str, Any]],
        *,
        progress: bool = True,
        max_queue_len: int | None = None,
    ) -> list[Job]:
        """Validate every job first, then enqueue them in pipelined chunks."""
        return self._run(core.submit_many(self.keys, items, progress, max_queue_len, self._new_job))

    def job(self, job_id: str, entry_id: str | None = None) -> Job:
        """Handle on an existing job (e.g. to resume its stream from another process)."""
        return Job(self, job_id, entry_id=entry_id)

    def queue_status(self) -> dict[str, Any]:
        """Lengths, pending counts and consumers of the default and per-model request
        streams, which models are published (and which have queued jobs nobody serves),
        dead-letter length."""
        return self._run(core.queue_status(self.keys))

    def close(self) -> None:
        if self._owns_redis:
            self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _new_job(self, job_id: str, enqueued: bool) -> Job:
        return Job(self, job_id, enqueued=enqueued)

    def _run(self, program: core.Program) -> Any:
        run = core.Run(program)
        for _ in self._drive(run):
            raise AssertionError("a program that emits, run for its result")
        return run.result

    def _drive(self, run: core.Run) -> Iterator[Any]:
        """Perform each I/O step of `run`, yielding what it emits."""
        for step in run:
            if isinstance(step, core.Emit):
                yield step.value
                continue
            try:
                run.reply(self._perform(step))
            except BaseException as exc:  # raised where the program made the call
                run.fail(exc)

    def _perform(self, step: core.Step) -> Any:
        if isinstance(step, core.Pipelined):
            pipe = self.redis.pipeline(transaction=False)
            for queued in step.steps:
                self._call(queued, pipe)
            return pipe.execute(raise_on_error=step.raise_on_error)
        if isinstance(step, core.Scan):
            return list(self.redis.scan_iter(match=step.match, _type=step.type))
        return self._call(step, self.redis)

    def _call(self, step: core.Call | core.Script, target: Any) -> Any:
        if isinstance(step, core.Script):
            if target is self.redis:
                return self._script(step)(step.keys, step.args, client=target)
            return queue_script_sync(self._script(step), step.keys, step.args, target)
        return getattr(target, step.method)(*step.args, **step.kwargs)


class Job(core.JobState):
    """Handle on one submitted job.

    `enqueued` (set by submit): True when this call enqueued it, False when a job with
    this id already existed (idempotent submit), None for handles from `client.job(id)`.
    """

    client: Client

    def stream(self, from_id: str = "0-0", timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield token events (each with `entry_id` to resume from) until the terminal event.

        Returns normally after `done`; raises JobFailed on `error`, JobCancelled on
        `cancelled`, Timeout when no event arrives for `timeout` seconds.
        """
        yield from self.client._drive(core.Run(core.stream(self, from_id, timeout)))

    def events(self, from_id: str = "0-0", timeout: float | None = None, *, idle: bool = True) -> Iterator[Event]:
        """Every accepted event up to and including the terminal one; never raises JobFailed.

        `timeout` bounds the wait for each next event (idle=True) or the whole call.
        """
        yield from self.client._drive(core.Run(core.events(self, from_id, timeout, idle)))

    def result(self, timeout: float | None = None) -> JobResult:
        """Wait at most `timeout` seconds in all for the terminal event.

        Raises JobFailed / JobCancelled / Timeout.
        """
        return self.client._run(core.result(self, timeout))

    def cancel(self) -> bool:
        """Request cancellation; False (and no write) for unknown or finished jobs."""
        return self.client._run(core.cancel(self))

    def status(self) -> JobStatus:
        return self.client._run(core.status(self))
