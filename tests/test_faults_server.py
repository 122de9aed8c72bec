"""Fault injection, the server: a private Valkey (AOF on) is restarted, taken down for ten
seconds, and brought back without its data, under one real `conveyor serve` replica."""

from __future__ import annotations

import shutil
import time

import pytest
import redis
from fault_harness import (
    JobLedger,
    check_attempt_sequences,
    private_server,
    record,
    spawner_fixture,
    unique_namespace,
    wait_until,
)
from model_factory import build_tiny_model

from conveyor.clients import Client
from conveyor.clients.keys import Keys

LEASE_S = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    valkey = private_server(tmp_path_factory.mktemp("faults_valkey"))
    yield valkey
    valkey.stop()


@pytest.fixture(scope="module")
def namespace():
    return unique_namespace("server")


@pytest.fixture(scope="module")
def replica(request, tmp_path_factory, server, namespace):
    """One replica for the module: two sequences at a time, four credits, so most of a
    burst of jobs waits in Redis (queued) while a few are in flight (pending)."""
    model = build_tiny_model("llama", tmp_path_factory.mktemp("server_llama"))
    for spawn in spawner_fixture(request, tmp_path_factory.mktemp("server_logs"), server.url):
        yield (
            spawn(namespace, "server-faults", model, lease_s=LEASE_S, args=["--max-num-seqs", "2"]).start().wait_ready()
        )


def jobs_of(count: int, tag: int, max_tokens: int = 60) -> list[dict]:
    return [
        {"prompt_token_ids": [5, 6, tag % 700, i], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        for i in range(count)
    ]


def outcome(server, namespace, job_ids, timeout=120.0) -> dict:
    """Wait for every job; each must end with exactly one `done` event. Returns the summary."""
    client = redis.Redis.from_url(server.url)
    try:
        ledger = JobLedger(client, namespace)
        ledger.wait_finished(job_ids, timeout)
        for rec in ledger.records(job_ids).values():
            assert [e.type for e in rec.terminals] == ["done"], (
                rec.job_id,
                [(e.type, e.attempt, e.entry_id) for e in rec.terminals],
                rec.hash.get(b"entry"),
            )
            check_attempt_sequences(rec)
        return ledger.summary(job_ids)
    finally:
        client.close()


def lengths(server, namespace) -> tuple[int, int]:
    """(entries in the request stream, of which pending = read by the replica, in flight)."""
    client = redis.Redis.from_url(server.url)
    try:
        stream = Keys(namespace).interactive
        return client.xlen(stream), client.xpending(stream, "engines")["pending"]
    finally:
        client.close()


def assert_same_process(replica, pid: int) -> None:
    assert replica.alive() and replica.pid == pid, f"replica restarted or died:\n{replica.log_tail()}"
    assert "crashed" not in replica.log_text() and "Traceback" not in replica.log_text()


@pytest.mark.slow
def test_jobs_accepted_before_a_server_restart_all_complete(server, namespace, replica):
    pid = replica.pid
    client = Client(server.url, namespace=namespace)
    jobs = client.submit_many(jobs_of(24, tag=1), progress=False)
    client.close()
    queued, in_flight = lengths(server, namespace)
    server.restart()  # SHUTDOWN (the AOF is flushed), then the same port and data dir

    summary = outcome(server, namespace, [job.job_id for job in jobs])
    assert_same_process(replica, pid)
    record("server restart (AOF kept)", **summary, queued_at_restart=queued, in_flight_at_restart=in_flight)
    assert summary["lost"] == 0 and summary["duplicates"] == 0


@pytest.mark.slow
def test_replica_rides_out_ten_seconds_without_a_server(server, namespace, replica):
    pid = replica.pid
    client = Client(server.url, namespace=namespace)
    before = client.submit_many(jobs_of(12, tag=2), progress=False)
    client.close()
    server.stop()
    down_until = time.monotonic() + 10.0
    while time.monotonic() < down_until:
        assert replica.alive(), f"replica died while the server was down:\n{replica.log_tail()}"
        time.sleep(0.5)
    server.start()
    client = Client(server.url, namespace=namespace)
    after = client.submit_many(jobs_of(12, tag=3), progress=False)
    client.close()

    summary = outcome(server, namespace, [job.job_id for job in before + after])
    assert_same_process(replica, pid)
    assert "Redis is back" in replica.log_text()
    record("server down 10 s", **summary, submitted_before=len(before), submitted_after=len(after))
    assert summary["lost"] == 0 and summary["duplicates"] == 0


@pytest.mark.slow
def test_consumer_group_recreated_when_the_server_comes_back_without_its_data(server, namespace, replica):
    pid = replica.pid
    wait_until(lambda: lengths(server, namespace) == (0, 0), 60, "the replica to be idle")
    marker = f"{namespace}:job:before-the-restart"
    with Client(server.url, namespace=namespace) as before:
        before.redis.hset(marker, "status", "done")
    server.stop()
    for name in ("appendonlydir", "dump.rdb"):
        path = server.data_dir / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    server.start()
    client = Client(server.url, namespace=namespace)
    # (not dbsize: the replica may already have written its own record and partition lease again)
    assert not client.redis.exists(marker), "the server kept its data"
    jobs = client.submit_many(jobs_of(6, tag=4), progress=False)
    client.close()

    summary = outcome(server, namespace, [job.job_id for job in jobs], timeout=60)
    assert_same_process(replica, pid)
    assert "consumer group missing" in replica.log_text()
    record("server restarted empty (NOGROUP)", **summary)
