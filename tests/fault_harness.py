"""Fault-injection harness: real `conveyor serve` processes on a real Valkey server.

- `ServeProcess`: one replica subprocess (env/flags, log file, readiness, kill -9, SIGTERM,
  SIGSTOP/SIGCONT, RSS, the entry ids it reclaimed according to its log).
- `start_all`: start several replicas in parallel and wait until every one is reading.
- `private_server`: a private EmbeddedValkey (AOF) for tests that stop/restart the server.
- `JobLedger`: reads jobs' out streams and hashes back and counts what the delivery
  contract promises (completed, lost, duplicate final results).
- `record`: one row of the reliability table (printed as a `RELIABILITY:` line and
  appended to a JSON-lines file; `python tests/fault_harness.py FILE` renders the table).

Nothing here mocks Redis or the replica: faults are real signals to real processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import msgpack
import redis
from redis.cluster import RedisCluster

REPO_ROOT = Path(__file__).resolve().parents[1]

from conveyor.clients.events import decode_event  # noqa: E402
from conveyor.clients.keys import GROUP, Keys  # noqa: E402

CONVEYOR = REPO_ROOT / ".venv" / "bin" / "conveyor"
TERMINAL = ("done", "error", "cancelled")
READY_TIMEOUT_S = 120.0  # replicas import torch + transformers: slow on a loaded 2-core box
RELIABILITY_FILE_ENV = "CONVEYOR_RELIABILITY_FILE"
RECLAIM_LINE = re.compile(r"reclaiming (\S+) (\d+-\d+)")


def unique_namespace(prefix: str = "fault") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy; AssertionError naming `what`."""
    ends = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > ends:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------- replicas


class ServeProcess:
    """One `conveyor serve` replica in its own process (and process group)."""

    def __init__(
        self,
        model: str,
        redis_url: str,
        namespace: str,
        consumer: str,
        log_dir: Path,
        *,
        lease_s: float | None = None,
        grace_s: float | None = None,
        max_deliveries: int | None = None,
        num_kv_blocks: int = 256,
        engine_process: bool = False,
        args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        keys: Keys | None = None,
    ) -> None:
        self.keys = keys or Keys(namespace)  # a cluster layout: the replica runs with --redis-cluster
        self.model = model
        self.redis_url = redis_url
        self.namespace = namespace
        self.consumer = consumer
        self.log_path = Path(log_dir) / f"{consumer}.log"
        flags = ["--model", model, "--redis-url", redis_url, "--namespace", namespace]
        for flag, value in (("--lease-s", lease_s), ("--grace-s", grace_s), ("--max-deliveries", max_deliveries)):
            if value is not None:
                flags += [flag, str(value)]
        if self.keys.cluster:
            flags += ["--redis-cluster", "--partitions", str(self.keys.partitions)]
        # the same engine core either way (actors/engine_client.py); its own process costs a
        # second interpreter per replica, so it is asked for where the process boundary is
        # what a test is about (crashes, drains, tensor-parallel ranks)
        flags += ["--engine-process", "true" if engine_process else "false"]
        self.command = [str(CONVEYOR), "serve", *flags, *args]
        self.env = {
            **os.environ,
            "CONVEYOR_CONSUMER": consumer,
            "CONVEYOR_LOG_LEVEL": "INFO",
            # a small KV pool (the 1 GiB CPU default, times several replicas, is wasted here)
            "CONVEYOR_NUM_KV_BLOCKS": str(num_kv_blocks),
            "OMP_NUM_THREADS": "1",  # tiny tensors; several replicas share two cores
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.env.pop("REDIS_URL", None)
        self.process: subprocess.Popen | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO_ROOT, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServeProcess:
        """Ready = registered as a consumer of the interactive stream (it has issued XREADGROUP)."""
        client = (RedisCluster if self.keys.cluster else redis.Redis).from_url(self.redis_url)
        try:
            wait_until(
                lambda: self._check_alive() and self.consumer in consumers(client, self.namespace, self.keys),
                timeout,
                f"replica {self.consumer} to start reading",
            )
        finally:
            client.close()
        return self

    def _check_alive(self) -> bool:
        if not self.alive():
            raise AssertionError(
                f"replica {self.consumer} exited with {self.returncode} during startup:\n{self.log_tail()}"
            )
        return True

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> int:
        """SIGKILL, as a power cut or the OOM killer would: no cleanup, no hand-back."""
        self.process.send_signal(signal.SIGKILL)
        return self.process.wait(10)

    def sigterm(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but runs nothing (a GC pause, a frozen VM)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Teardown: SIGKILL whatever is left (tests check graceful exits themselves)."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.process.kill()
            self.process.wait(10)

    # ---- observation -----------------------------------------------------------------
    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process(self.pid).memory_info().rss

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def reclaimed_entries(self) -> list[str]:
        """Entry ids this replica took over with XAUTOCLAIM (its `reclaiming ...` log lines)."""
        return [match.group(2) for match in RECLAIM_LINE.finditer(self.log_text())]

    def __repr__(self) -> str:
        return f"<ServeProcess {self.consumer} pid={self.process.pid if self.process else None}>"


def start_all(replicas: Iterable[ServeProcess], timeout: float = READY_TIMEOUT_S) -> list[ServeProcess]:
    """Start every replica at once (startups overlap), then wait until each reads."""
    replicas = list(replicas)
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.wait_ready(timeout)
    return replicas


def consumers(client: redis.Redis, namespace: str, keys: Keys | None = None) -> set[str]:
    try:
        infos = client.xinfo_consumers((keys or Keys(namespace)).interactive, GROUP)
    except redis.ResponseError:  # no stream or group yet
        return set()
    return {_text(info["name"]) for info in infos}


def pending_owners(client: redis.Redis, namespace: str) -> dict[str, str]:
    """Pending entry id -> consumer holding it, on both request streams."""
    owners = {}
    for stream in Keys(namespace).all_requests:
        try:
            for item in client.xpending_range(stream, GROUP, min="-", max="+", count=100_000):
                owners[_text(item["message_id"])] = _text(item["consumer"])
        except redis.ResponseError:
            pass
    return owners


def pending_details(client: redis.Redis, stream: str) -> list[dict]:
    """XPENDING extended form: message_id, consumer, time_since_delivered (ms), times_delivered."""
    try:
        return client.xpending_range(stream, GROUP, min="-", max="+", count=100_000)
    except redis.ResponseError:
        return []


# --------------------------------------------------------------------------- server


def private_server(data_dir: Path):
    """A private embedded Valkey with AOF, for tests that stop or restart the server."""
    from conveyor.actors.embedded_valkey import EmbeddedValkey

    return EmbeddedValkey(data_dir, port=0, appendonly=True, password=None).start()  # loopback, temp dir


# --------------------------------------------------------------------------- outcomes


@dataclass
class JobRecord:
    """Everything a job left in Redis: its events (decoded, in stream order) and its hash."""

    job_id: str
    events: list = field(default_factory=list)
    hash: dict = field(default_factory=dict)

    @property
    def terminals(self) -> list:
        return [e for e in self.events if e.type in TERMINAL]

    @property
    def tokens(self) -> list:
        return [e for e in self.events if e.type == "token"]

    @property
    def attempt(self) -> int:
        return int(self.hash.get(b"attempt", 0) or 0)

    @property
    def status(self) -> str | None:
        return _text(self.hash.get(b"status"))

    def tokens_of(self, attempt: int) -> list:
        return [e for e in self.tokens if e.attempt == attempt]


class JobLedger:
    """Reads back jobs' outcomes in pipelined batches."""

    def __init__(self, client: redis.Redis, namespace: str, keys: Keys | None = None) -> None:
        self.redis = client
        self.keys = keys or Keys(namespace)

    def statuses(self, job_ids: list[str]) -> list[str | None]:
        out = []
        for chunk in _chunks(job_ids, 1000):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hget(self.keys.job(job_id), "status")
            out += [_text(s) for s in pipe.execute()]
        return out

    def wait_finished(self, job_ids: list[str], timeout: float, what: str = "jobs") -> None:
        def finished():
            return all(s in TERMINAL for s in self.statuses(job_ids))

        wait_until(finished, timeout, f"{len(job_ids)} {what} to finish", interval=0.25)

    def records(self, job_ids: list[str]) -> dict[str, JobRecord]:
        records = {}
        for chunk in _chunks(job_ids, 500):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in chunk:
                pipe.xrange(self.keys.out(job_id))
                pipe.hgetall(self.keys.job(job_id))
            replies = pipe.execute()
            for index, job_id in enumerate(chunk):
                entries, fields = replies[2 * index], replies[2 * index + 1]
                records[job_id] = JobRecord(job_id, [decode_event(f, i) for i, f in entries], fields)
        return records

    def record(self, job_id: str) -> JobRecord:
        return self.records([job_id])[job_id]

    def dead_letters(self) -> list[dict]:
        return [
            {_text(k): v for k, v in fields.items()} | {"id": _text(entry_id)}
            for entry_id, fields in self.redis.xrange(self.keys.dead)
        ]

    def summary(self, job_ids: list[str]) -> dict[str, int]:
        """completed: exactly one terminal event; lost: none; duplicates: terminal events beyond one."""
        records = self.records(job_ids)
        completed = sum(1 for r in records.values() if r.terminals)
        duplicates = sum(max(0, len(r.terminals) - 1) for r in records.values())
        return {
            "submitted": len(job_ids),
            "completed": completed,
            "lost": len(job_ids) - completed,
            "duplicates": duplicates,
        }


def check_attempt_sequences(record: JobRecord) -> None:
    """Protocol rules on one job's events: seq from 0 without gaps within every attempt,
    and at most one terminal event per attempt."""
    by_attempt: dict[int, list[int]] = {}
    for event in record.tokens:
        by_attempt.setdefault(event.attempt, []).append(event.seq)
    for attempt, seqs in by_attempt.items():
        assert seqs == list(range(len(seqs))), f"{record.job_id} attempt {attempt}: seqs {seqs[:20]}..."
    terminal_attempts = [e.attempt for e in record.terminals]
    assert len(terminal_attempts) == len(set(terminal_attempts)), (
        f"{record.job_id}: two terminal events for one attempt: {terminal_attempts}"
    )


def raw_job(job: dict) -> dict[str, bytes]:
    """Request-stream fields of `job` as a producer without the Python client writes them."""
    return {"data": msgpack.packb(job, use_bin_type=True)}


# --------------------------------------------------------------------------- reliability table


def reliability_file() -> Path:
    """$CONVEYOR_RELIABILITY_FILE (appended to), else a temp file rewritten by each test run
    (conftest's ``start_reliability_file``, once per run, before any test worker starts)."""
    path = os.environ.get(RELIABILITY_FILE_ENV)
    if path:
        return Path(path)
    import tempfile

    return Path(tempfile.gettempdir()) / "conveyor-reliability.jsonl"


def start_reliability_file() -> int:
    """Called once per run by the process that prints the table: every test worker then
    appends to the same file; returns where this run's rows start."""
    path = reliability_file()
    if not os.environ.get(RELIABILITY_FILE_ENV):
        path.write_text("")
        os.environ[RELIABILITY_FILE_ENV] = str(path)
    return path.stat().st_size if path.exists() else 0


def record(fault: str, *, submitted: int, completed: int, lost: int, duplicates: int, **extra) -> dict:
    """One row of docs/reliability.md's table: printed and appended to reliability_file()."""
    row = {
        "fault": fault,
        "submitted": submitted,
        "completed": completed,
        "lost": lost,
        "duplicates": duplicates,
        **extra,
    }
    details = "".join(f", {k}={v}" for k, v in extra.items())
    print(
        f"\nRELIABILITY: fault={fault}, submitted={submitted}, completed={completed}, lost={lost}, "
        f"duplicates={duplicates}{details}",
        flush=True,
    )
    with open(reliability_file(), "a") as out:
        out.write(json.dumps(row) + "\n")
    return row


def recorded_table(start: int) -> str | None:
    """This run's rows (from ``start`` in the file: every test worker's) as a table (conftest
    prints it in pytest's terminal summary)."""
    path = reliability_file()
    if not path.exists():
        return None
    with open(path) as source:
        source.seek(start)
        rows = [json.loads(line) for line in source if line.strip()]
    return markdown_table(rows) if rows else None


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| fault injected | jobs submitted | jobs completed | jobs lost | duplicate final results | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        notes = ", ".join(
            f"{k}={v}" for k, v in row.items() if k not in ("fault", "submitted", "completed", "lost", "duplicates")
        )
        lines.append(
            f"| {row['fault']} | {row['submitted']} | {row['completed']} | {row['lost']} | "
            f"{row['duplicates']} | {notes} |"
        )
    total = {k: sum(r[k] for r in rows) for k in ("submitted", "completed", "lost", "duplicates")}
    lines.append(
        f"| **total** | **{total['submitted']}** | **{total['completed']}** | **{total['lost']}** | "
        f"**{total['duplicates']}** | |"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- helpers


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _text(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


if __name__ == "__main__":  # render a run's table: python tests/fault_harness.py FILE.jsonl
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    print(markdown_table(rows))


# --------------------------------------------------------------------------- pytest glue


def make_spawner(log_dir: Path, default_url: str, engine_process: bool = False):
    """A factory of ServeProcess that remembers what it made (for teardown)."""
    made: list[ServeProcess] = []

    def spawn(namespace: str, consumer: str, model: str, redis_url: str | None = None, **options) -> ServeProcess:
        options.setdefault("engine_process", engine_process)
        replica = ServeProcess(model, redis_url or default_url, namespace, consumer, log_dir, **options)
        made.append(replica)
        return replica

    spawn.made = made
    return spawn


def stop_all(made: list[ServeProcess], show_logs: bool = False) -> None:
    """Kill what is left; with show_logs (the test failed), print every replica's log tail."""
    codes = {replica.consumer: replica.returncode for replica in made}
    for replica in made:
        replica.stop()
    if show_logs:
        for replica in made:
            print(
                f"----- log of {replica.consumer} (exit code before teardown: {codes[replica.consumer]}) -----\n"
                f"{replica.log_tail(3000)}"
            )


def spawner_fixture(request, log_dir: Path, redis_url: str, engine_process: bool = False):
    """Body of a `spawn` fixture: yields make_spawner(); teardown kills what is left and
    prints the replicas' logs when the test failed."""
    failed_before = request.session.testsfailed
    spawner = make_spawner(log_dir, redis_url, engine_process)
    yield spawner
    stop_all(spawner.made, show_logs=request.session.testsfailed > failed_before)
