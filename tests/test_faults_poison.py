"""Fault injection, poison jobs and key hygiene.

Two replicas run with CONVEYOR_FAULT_INJECTION=1 under a supervisor that restarts whatever
exits (as docker's `restart: always` would). A job carrying `{"conveyor_fault": "crash"}`
kills each replica that starts it; after `max_deliveries` it must be dead-lettered with an
error event, and the cluster must keep serving. Then every key the run left behind
(successes, errors, dead letters, cancels, crashes) must carry a TTL, except the request
streams."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fault_harness import JobLedger, check_attempt_sequences, raw_job, record, spawner_fixture, start_all, wait_until
from model_factory import build_tiny_model
from scratch import scratch_namespace

from conveyor.clients import Client
from conveyor.clients.errors import JobCancelled, JobFailed
from conveyor.clients.keys import Keys

LEASE_S = 2.0
MAX_DELIVERIES = 2
CRASH_EXIT_CODE = 70  # actors/faults.py


class Supervisor(threading.Thread):
    """Restarts every replica that exits, under a new consumer name (a new container)."""

    def __init__(self, spawn, replicas, **options) -> None:
        super().__init__(daemon=True)
        self.spawn, self.options = spawn, options
        self.slots = list(replicas)
        self.exits: list[tuple[str, int]] = []
        self.running = True

    def run(self) -> None:
        while self.running:
            for index, replica in enumerate(self.slots):
                if replica.returncode is not None and self.running:
                    self.exits.append((replica.consumer, replica.returncode))
                    base = replica.consumer.rsplit("-r", 1)[0]
                    self.slots[index] = self.spawn(
                        replica.namespace, f"{base}-r{len(self.exits)}", replica.model, **self.options
                    ).start()
            time.sleep(0.1)

    def stop(self) -> None:
        self.running = False
        self.join(5)


@pytest.fixture(scope="module")
def namespace(redis_url):
    with scratch_namespace(redis_url, "poison") as ns:
        yield ns


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory, redis_url, namespace):
    model = build_tiny_model("llama", tmp_path_factory.mktemp("poison_llama"))
    options = dict(lease_s=LEASE_S, max_deliveries=MAX_DELIVERIES, env={"CONVEYOR_FAULT_INJECTION": "1"})
    for spawn in spawner_fixture(request, tmp_path_factory.mktemp("poison_logs"), redis_url, engine_process=True):
        replicas = start_all([spawn(namespace, f"poison-{n}", model, **options) for n in "ab"])
        supervisor = Supervisor(spawn, replicas, **options)
        supervisor.start()
        yield supervisor
        supervisor.stop()


def good_jobs(count: int, tag: int, max_tokens: int = 20) -> list[dict]:
    return [
        {"prompt_token_ids": [5, 6, tag, i], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        for i in range(count)
    ]


@pytest.mark.slow
def test_poison_job_crashes_each_replica_until_max_deliveries_then_is_dead_lettered(cluster, redis_url, namespace, raw):
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    poison = client.submit(prompt="def boom():", max_tokens=5, metadata={"conveyor_fault": "crash"})
    with pytest.raises(JobFailed) as failure:
        poison.result(timeout=150)
    assert failure.value.code == "max_deliveries" and failure.value.attempt == MAX_DELIVERIES + 1
    assert failure.value.metadata == {"conveyor_fault": "crash"}

    assert [code for _, code in cluster.exits] == [CRASH_EXIT_CODE] * MAX_DELIVERIES
    rec = ledger.record(poison.job_id)
    assert rec.tokens == [] and rec.attempt == MAX_DELIVERIES + 1
    assert [(e.type, e.attempt) for e in rec.terminals] == [("error", MAX_DELIVERIES + 1)]
    dead = [d for d in ledger.dead_letters() if b"conveyor_fault" in d.get("field:data", b"")]
    assert len(dead) == 1 and b"max_deliveries" in dead[0]["reason"]
    assert raw.xlen(Keys(namespace).interactive) == 0

    # the restarted cluster serves normally afterwards
    jobs = client.submit_many(good_jobs(6, tag=1), progress=False)
    assert all(job.result(timeout=90).attempt == 1 for job in jobs)
    summary = ledger.summary([poison.job_id] + [j.job_id for j in jobs])
    record(
        f"poison job (crashes its replica; max_deliveries={MAX_DELIVERIES})",
        **summary,
        replica_crashes=len(cluster.exits),
        dead_lettered=1,
    )
    assert summary["lost"] == 0 and summary["duplicates"] == 0


@pytest.mark.slow
def test_every_key_but_the_request_streams_has_a_ttl(cluster, redis_url, namespace, raw):
    """After successes, errors, dead letters, cancels and (in the test above) crashes."""
    client, ledger, keys = Client(redis_url, namespace=namespace), JobLedger(raw, namespace), Keys(namespace)
    done = client.submit_many(good_jobs(3, tag=2), progress=False)
    raw.xadd(keys.interactive, {"json": json.dumps({"job_id": "raw-producer", "prompt": "hi", "max_tokens": 2})})
    raw.xadd(keys.interactive, raw_job({"job_id": "bad-field", "prompt": "hi", "top_p": 7}))  # error + dead letter
    raw.xadd(keys.interactive, {"data": b"\xc1 not msgpack"})  # dead letter only
    too_long = client.submit(prompt_token_ids=[5] * 1000, max_tokens=200)  # engine-level error
    late = client.submit(prompt="late", max_tokens=2, deadline=time.time() - 1)
    cancelled = client.submit(**good_jobs(1, tag=3, max_tokens=1000)[0])
    wait_until(lambda: ledger.record(cancelled.job_id).tokens, 60, "the job to cancel to run")
    cancelled.cancel()

    outcomes = {
        "raw-producer": None,
        "bad-field": "invalid_job",
        too_long.job_id: "invalid_request",
        late.job_id: "deadline_exceeded",
    }
    for job in done:
        job.result(timeout=60)
    for job_id, code in outcomes.items():
        if code is None:
            client.job(job_id).result(timeout=60)
        else:
            with pytest.raises(JobFailed) as failure:
                client.job(job_id).result(timeout=60)
            assert failure.value.code == code
    with pytest.raises(JobCancelled):
        cancelled.result(timeout=60)
    wait_until(lambda: raw.xlen(keys.interactive) == 0, 30, "the request stream to empty")
    for rec in ledger.records(list(outcomes) + [cancelled.job_id]).values():
        assert len(rec.terminals) == 1
        check_attempt_sequences(rec)

    without_ttl, kinds = [], set()
    for key in raw.scan_iter(match=f"{namespace}:*", count=1000):
        name = key.decode()
        kinds.add(name.split(":")[1])
        if name.startswith(f"{namespace}:requests:"):
            continue
        if raw.ttl(key) <= 0:
            without_ttl.append((name, raw.type(key).decode(), raw.ttl(key)))
    assert {"job", "out", "dead", "requests"} <= kinds, kinds
    assert not without_ttl, f"keys without a TTL: {without_ttl[:10]}"
    ids = [j.job_id for j in done] + list(outcomes) + [cancelled.job_id]
    record("mixed outcomes, then SCAN for keys without TTL", **ledger.summary(ids), keys_without_ttl=0)
