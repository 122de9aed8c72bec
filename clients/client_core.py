"""The one client: every decision of Client and AsyncClient, with no I/O.

Each operation is a *program*: a generator that yields the Redis round trips it needs as
plain data (Call, Script, Pipelined, Scan) and is sent their replies, or yields Emit(value)
for a value its caller should see (streamed events). It returns the operation's result.
clients/client.py and clients/async_client.py are drivers: each performs these steps with
its own connection (blocking or awaited) and nothing else, so the two cannot drift apart.
No event loop runs in a thread: the sync driver blocks on plain redis-py calls.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterable

from tqdm import tqdm

from conveyor.clients.connection import client_settings
from conveyor.clients.event_reader import (
    READ_COUNT,
    Deadline,
    EventReader,
    entries_of,
    outcome,
    status_from_hash,
    terminal_from_hash,
)
from conveyor.clients.events import Event, TerminalEvent
from conveyor.clients.job_record import CANCEL_LUA, SUBMIT_LUA
from conveyor.clients.keys import PRIORITY_CLASSES, Keys
from conveyor.clients.queue_status import model_names, queue_status_commands, queue_status_from
from conveyor.clients.redis_cluster import is_cluster
from conveyor.clients.submission import (
    ENQUEUED,
    SUBMIT_CHUNK,
    build_job,
    build_jobs,
    cancel_args,
    check_chunk,
    check_submitted,
    submit_args,
)


class Call:
    """One command on the connection: `redis.<method>(*args, **kwargs)`; reply: its reply."""

    __slots__ = ("method", "args", "kwargs")

    def __init__(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs


class Script:
    """One run of a registered script ("submit" or "cancel"); reply: the script's reply."""

    __slots__ = ("name", "keys", "args")

    def __init__(self, name: str, keys: list, args: list) -> None:
        self.name, self.keys, self.args = name, keys, args


class Pipelined:
    """Calls and Scripts in one round trip (no transaction); reply: their replies in order."""

    __slots__ = ("steps", "raise_on_error")

    def __init__(self, steps: list[Call | Script], raise_on_error: bool = True) -> None:
        self.steps, self.raise_on_error = steps, raise_on_error


class Scan:
    """Every key matching `match` of type `type` (all SCAN cursors); reply: a list of keys."""

    __slots__ = ("match", "type")

    def __init__(self, match: str, type: str) -> None:
        self.match, self.type = match, type


class Emit:
    """Not I/O: `value` goes to the caller of a streaming program; reply: None."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


Step = Call | Script | Pipelined | Scan | Emit
Program = Generator[Step, Any, Any]


class Run:
    """Steps a program for a driver: iterating gives the next step; after an I/O step the
    driver calls `reply` (or `fail`, which raises the error inside the program, where it
    propagates or is handled as if the program had made the call itself). `result` holds
    the program's return value once iteration stops."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.result: Any = None
        self._reply: Any = None
        self._error: BaseException | None = None

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> Step:
        reply, error, self._reply, self._error = self._reply, self._error, None, None
        try:
            return self.program.throw(error) if error is not None else self.program.send(reply)
        except StopIteration as stop:
            self.result = stop.value
            raise StopIteration from None

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, error: BaseException) -> None:
        self._error = error


def connect(
    redis_url: str | None, connection: Any, redis_client: Any, partitions: int | None, asynchronous: bool
) -> tuple[Any, int | None]:
    """A client's Redis connection (its own from the URL or RedisSettings, unless
    `redis_client` is given; creating one does no I/O) and its partitions (given, else the settings')."""
    if redis_client is not None:
        return redis_client, partitions
    settings = client_settings(redis_url, connection)
    return (settings.async_client() if asynchronous else settings.client()), partitions or settings.partitions


class ClientState:
    """What both clients hold: the connection (`redis`), the namespace's `keys` (the
    cluster layout on a cluster client) and the two registered scripts. Registering a
    script does no I/O."""

    def __init__(self, redis: Any, namespace: str | None, owns_redis: bool, partitions: int | None = None) -> None:
        self._owns_redis = owns_redis
        self.redis = redis
        self.keys = Keys.of(namespace, cluster=is_cluster(redis), partitions=partitions)
        self._submit_script = redis.register_script(SUBMIT_LUA)
        self._cancel_script = redis.register_script(CANCEL_LUA)

    def _script(self, step: Script) -> Any:
        return self._cancel_script if step.name == "cancel" else self._submit_script


class JobState:
    """What both job handles hold (see clients.client.Job)."""

    def __init__(self, client: Any, job_id: str, enqueued: bool | None = None, entry_id: str | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.enqueued = enqueued
        self.entry_id = entry_id  # the request entry (raw XADD reply): refusals of others are skipped
        self._terminal: TerminalEvent | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.job_id!r})"


# Client programs. `make_job(job_id, enqueued=...)` builds the driver's own job handle.


def submit(keys: Keys, fields: dict[str, Any], max_queue_len: int | None, make_job: Callable) -> Program:
    job = build_job(fields)
    code = yield Script("submit", *submit_args(keys, job, max_queue_len))
    check_submitted(code, job, keys, max_queue_len)
    return make_job(job.job_id, enqueued=code == ENQUEUED)


def submit_many(
    keys: Keys, items: Iterable[dict[str, Any]], progress: bool, max_queue_len: int | None, make_job: Callable
) -> Program:
    requests = build_jobs(items)
    jobs: list = []
    with tqdm(total=len(requests), disable=not progress, unit="job", desc="submit") as bar:
        for start in range(0, len(requests), SUBMIT_CHUNK):
            chunk = requests[start : start + SUBMIT_CHUNK]
            codes = yield Pipelined([Script("submit", *submit_args(keys, job, max_queue_len)) for job in chunk])
            jobs.extend(make_job(job.job_id, enqueued=code == ENQUEUED) for job, code in zip(chunk, codes) if code >= 0)
            check_chunk(codes, chunk, keys, max_queue_len, jobs)
            bar.update(len(chunk))
    return jobs


def queue_status(keys: Keys) -> Program:
    streams: list = []
    for priority_class in PRIORITY_CLASSES:
        streams += yield Scan(keys.model_requests_pattern(priority_class), "STREAM")
    models = model_names(keys, (yield Call("smembers", keys.models)), streams)
    commands = [Call(method, *args) for method, *args in queue_status_commands(keys, models)]
    return queue_status_from(keys, models, (yield Pipelined(commands, raise_on_error=False)))


# Job programs


class JobReading:
    """One read of a job's out stream: the XREAD to make next, and the events its reply
    holds (stale owners fenced, duplicates dropped, see EventReader). Raises Timeout when
    a reply holds nothing and `timeout` has passed since the start (or, with idle=True,
    since the last accepted event)."""

    def __init__(self, job: JobState, from_id: str, timeout: float | None, idle: bool) -> None:
        self.job_id, self.out_key, self.idle = job.job_id, job.client.keys.out(job.job_id), idle
        self.reader, self.deadline = EventReader(from_id, job.entry_id), Deadline(timeout)
        self.terminal: TerminalEvent | None = None

    def read(self) -> Call:
        return Call("xread", {self.out_key: self.reader.last_id}, count=READ_COUNT, block=self.deadline.block_ms())

    def feed(self, reply: Any) -> list[Event]:
        events = self.reader.feed(entries_of(reply))
        if not events:
            self.deadline.raise_if_expired(self.job_id, "event")
        elif self.idle:
            self.deadline.restart()
        if events and events[-1].is_terminal:
            self.terminal = events[-1]
        return events


def events(job: JobState, from_id: str, timeout: float | None, idle: bool) -> Program:
    """Every accepted event up to and including the terminal one."""
    reading = JobReading(job, from_id, timeout, idle)
    while reading.terminal is None:
        for event in reading.feed((yield reading.read())):
            yield Emit(event)


def stream(job: JobState, from_id: str, timeout: float | None) -> Program:
    """Token events; at the terminal event, keeps it on the job and raises for error/cancelled."""
    reading = JobReading(job, from_id, timeout, idle=True)
    while reading.terminal is None:
        for event in reading.feed((yield reading.read())):
            if event.is_terminal:
                job._terminal = event
                outcome(job.job_id, event)
            else:
                yield Emit(event)


def result(job: JobState, timeout: float | None) -> Program:
    if job._terminal is None:
        job._terminal = terminal_from_hash((yield Call("hgetall", job.client.keys.job(job.job_id))))
    if job._terminal is None:
        reading = JobReading(job, "0-0", timeout, idle=False)  # `timeout` bounds the whole wait
        while reading.terminal is None:
            reading.feed((yield reading.read()))
        job._terminal = reading.terminal
    return outcome(job.job_id, job._terminal)


def cancel(job: JobState) -> Program:
    return bool((yield Script("cancel", *cancel_args(job.client.keys, job.job_id))))


def status(job: JobState) -> Program:
    return status_from_hash(job.job_id, (yield Call("hgetall", job.client.keys.job(job.job_id))))
