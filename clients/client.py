"""Synchronous client: submit jobs, stream their tokens, wait for results, cancel."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import redis
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


class Client:
    """Producer/consumer handle on one Conveyor namespace.

    Connects to `redis_url` (credentials and TLS from the environment, see
    clients/connection.py), or with `connection` (RedisSettings: password, ACL user, TLS
    files), or through `redis_client`, which must use `decode_responses=False`.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        connection: RedisSettings | None = None,
        redis_client: redis.Redis | None = None,
    ) -> None:
        self._owns_redis = redis_client is None
        self.redis = redis_client or client_settings(redis_url, connection).client()
        self.keys = Keys(namespace or default_namespace())
        self._submit_script = self.redis.register_script(SUBMIT_LUA)
        self._cancel_script = self.redis.register_script(CANCEL_LUA)

    def submit(self, prompt: str | None = None, *, max_queue_len: int | None = None, **fields: Any) -> Job:
        """Validate, then enqueue one job (idempotent per job_id). See JobRequest for fields."""
        job = build_job({"prompt": prompt, **fields})
        keys, args = submit_args(self.keys, job, max_queue_len)
        code = self._submit_script(keys, args)
        check_submitted(code, job, self.keys, max_queue_len)
        return Job(self, job.job_id, enqueued=code == ENQUEUED)

    def submit_many(
        self,
        items: Iterable[dict[str, Any]],
        *,
        progress: bool = True,
        max_queue_len: int | None = None,
    ) -> list[Job]:
        """Validate every job first, then enqueue them in pipelined chunks."""
        requests = build_jobs(items)
        jobs: list[Job] = []
        with tqdm(total=len(requests), disable=not progress, unit="job", desc="submit") as bar:
            for start in range(0, len(requests), SUBMIT_CHUNK):
                chunk = requests[start : start + SUBMIT_CHUNK]
                self._submit_chunk(chunk, max_queue_len, jobs)
                bar.update(len(chunk))
        return jobs

    def _submit_chunk(self, chunk: list, max_queue_len: int | None, jobs: list[Job]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for job in chunk:
            self._submit_script(*submit_args(self.keys, job, max_queue_len), client=pipe)
        codes = pipe.execute()
        jobs.extend(Job(self, job.job_id, enqueued=code == ENQUEUED) for job, code in zip(chunk, codes)
                    if code >= 0)  # fmt: skip
        check_chunk(codes, chunk, self.keys, max_queue_len, jobs)

    def job(self, job_id: str, entry_id: str | None = None) -> Job:
        """Handle on an existing job (e.g. to resume its stream from another process)."""
        return Job(self, job_id, entry_id=entry_id)

    def queue_status(self) -> dict[str, Any]:
        """Lengths, pending counts and consumers of the default and per-model request
        streams, which models are published (and which have queued jobs nobody serves),
        dead-letter length."""
        streams = [k for c in PRIORITY_CLASSES for k in self.redis.scan_iter(
            match=self.keys.model_requests_pattern(c), _type="STREAM")]  # fmt: skip
        models = model_names(self.keys, self.redis.smembers(self.keys.models), streams)
        pipe = self.redis.pipeline(transaction=False)
        queue_status_commands(pipe, self.keys, models)
        return queue_status_from(self.keys, models, pipe.execute(raise_on_error=False))

    def close(self) -> None:
        if self._owns_redis:
            self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Job:
    """Handle on one submitted job.

    `enqueued` (set by submit): True when this call enqueued it, False when a job with
    this id already existed (idempotent submit), None for handles from `client.job(id)`.
    """

    def __init__(self, client: Client, job_id: str, enqueued: bool | None = None, entry_id: str | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.enqueued = enqueued
        self.entry_id = entry_id  # the request entry (raw XADD reply): refusals of others are skipped
        self._terminal: TerminalEvent | None = None

    def __repr__(self) -> str:
        return f"Job({self.job_id!r})"

    def stream(self, from_id: str = "0-0", timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield token events (each with `entry_id` to resume from) until the terminal event.

        Returns normally after `done`; raises JobFailed on `error`, JobCancelled on
        `cancelled`, Timeout when no event arrives for `timeout` seconds.
        """
        for event in self.events(from_id, timeout):
            if event.is_terminal:
                self._terminal = event
                outcome(self.job_id, event)
                return
            yield event

    def events(self, from_id: str = "0-0", timeout: float | None = None, *, idle: bool = True) -> Iterator[Event]:
        """Every accepted event up to and including the terminal one; never raises JobFailed.

        `timeout` bounds the wait for each next event (idle=True) or the whole call.
        """
        reader, deadline = EventReader(from_id, self.entry_id), Deadline(timeout)
        out_key = self.client.keys.out(self.job_id)
        while True:
            reply = self.client.redis.xread({out_key: reader.last_id}, count=READ_COUNT, block=deadline.block_ms())
            events = reader.feed(entries_of(reply))
            if not events:
                deadline.raise_if_expired(self.job_id, "event")
                continue
            if idle:
                deadline.restart()
            yield from events
            if events[-1].is_terminal:
                return

    def result(self, timeout: float | None = None) -> JobResult:
        """Wait at most `timeout` seconds in all for the terminal event.

        Raises JobFailed / JobCancelled / Timeout.
        """
        if self._terminal is None:
            self._terminal = self._stored_terminal() or self._await_terminal(timeout)
        return outcome(self.job_id, self._terminal)

    def _stored_terminal(self) -> TerminalEvent | None:
        return terminal_from_hash(self.client.redis.hgetall(self.client.keys.job(self.job_id)))

    def _await_terminal(self, timeout: float | None) -> TerminalEvent:
        for event in self.events(timeout=timeout, idle=False):
            if event.is_terminal:
                return event
        raise AssertionError("events() ended without a terminal event")

    def cancel(self) -> bool:
        """Request cancellation; False (and no write) for unknown or finished jobs."""
        keys, args = cancel_args(self.client.keys, self.job_id)
        return bool(self.client._cancel_script(keys, args))

    def status(self) -> JobStatus:
        return status_from_hash(self.job_id, self.client.redis.hgetall(self.client.keys.job(self.job_id)))
