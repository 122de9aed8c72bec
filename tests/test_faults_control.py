"""Fault injection, job control: cancellation (queued and running), deadlines (passed before
the start and expiring while running), idempotent and conflicting submits.

An in-process replica (tests/replica_harness.py: real actors, real Valkey) so that the
engine's KV accounting can be read while it serves: a cancelled or expired job must give
its KV blocks back. One sequence at a time and two credits, so a third job waits in Redis."""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from fault_harness import JobLedger, check_attempt_sequences, record, wait_until
from model_factory import build_tiny_model
from replica_harness import ReplicaThread
from scratch import scratch_namespace

from conveyor.actors.messages import HeldJobs, ReadEntry, Reclaimed
from conveyor.clients import Client
from conveyor.clients.errors import ConveyorError, JobCancelled, JobFailed
from conveyor.clients.keys import GROUP

LONG = 1000  # tokens: 0.6-2 s on the tiny model, long enough to act on a running job
BLOCKER = 4000  # tokens: a blocker must outlast a test's waits even on a fast CPU (cancelled after)


@pytest.fixture(scope="module")
def module_namespace(redis_url):
    with scratch_namespace(redis_url, "control") as ns:
        yield ns


@pytest.fixture(scope="module")
def control_model(tmp_path_factory):
    """The tiny Llama with room for BLOCKER-token jobs."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("control_llama"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def replica(control_model, redis_url, module_namespace):
    running = ReplicaThread(
        control_model, redis_url, module_namespace, consumer="control", max_num_seqs=1, num_kv_blocks=256
    ).start()
    yield running
    for job_id in running.call(held_jobs(running)):  # nothing should be left; don't wait for it
        Client(redis_url, namespace=module_namespace).job(job_id).cancel()
    running.stop()


@pytest.fixture
def client(redis_url, module_namespace):
    with Client(redis_url, namespace=module_namespace) as c:
        yield c


@pytest.fixture
def ledger(redis_url, module_namespace):
    raw = redis.Redis.from_url(redis_url)
    yield JobLedger(raw, module_namespace)
    raw.close()


def long_job(tag: int, max_tokens: int = LONG, **extra) -> dict:
    return {
        "prompt_token_ids": [5, 6, 7, tag % 700],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


async def held_jobs(replica: ReplicaThread) -> list[str]:
    """The ledger's answer, asked on the replica's loop (from ``ReplicaThread.call``)."""
    return await replica.replica.ledger.ask(HeldJobs())


def replica_state(replica: ReplicaThread) -> dict:
    """The engine's KV stats and the replica's bookkeeping, read on the replica's own loop."""

    async def snapshot():
        return {
            **replica.engine.stats(),
            "held": len(await held_jobs(replica)),
            "scheduled_jobs": replica.replica.engine_core.num_jobs,
        }

    return replica.call(snapshot())


def assert_idle(replica: ReplicaThread) -> None:
    """No job left anywhere in the replica and every KV block back in the pool."""

    def idle():
        state = replica_state(replica)
        return (
            state
            if (state["held"], state["scheduled_jobs"], state["num_running"], state["num_waiting"], state["kv_usage"])
            == (0, 0, 0, 0, 0.0)
            else None
        )

    wait_until(idle, 30, f"the replica to be idle with its KV cache free (now {replica_state(replica)})")


def wait_tokens(ledger: JobLedger, job_id: str, count: int = 3) -> None:
    wait_until(lambda: len(ledger.record(job_id).tokens) >= count, 60, f"{job_id} to stream tokens")


def hold_both_credits(client, ledger, tag):
    """Two long jobs: one running, one waiting in the engine; the replica has no credit left."""
    blockers = [client.submit(**long_job(tag + i, max_tokens=BLOCKER)) for i in range(2)]
    wait_tokens(ledger, blockers[0].job_id, 1)
    # both delivered: a job submitted next cannot take the second credit (the blockers may sit
    # in different partitions, read in turn: on a loaded box the second was read after it)
    wait_until(lambda: delivered(ledger) >= 2, 30, "the replica to take both blockers")
    return blockers


def delivered(ledger: JobLedger) -> int:
    """Entries the replica holds (read, not yet acknowledged), over every request stream."""
    pipe = ledger.redis.pipeline(transaction=False)
    for stream in ledger.keys.all_requests:
        pipe.xpending(stream, GROUP)
    return sum(summary["pending"] for summary in pipe.execute(raise_on_error=False) if isinstance(summary, dict))


def release(blockers) -> None:
    """Cancel the blockers (one may have finished already) and wait for both to end."""
    for job in blockers:
        job.cancel()
    for job in blockers:
        try:
            job.result(timeout=30)
        except JobCancelled:
            pass


def terminal_kinds(rec) -> list[tuple]:
    return [(e.type, e.attempt, getattr(e, "code", None)) for e in rec.terminals]


# --------------------------------------------------------------------------- cancellation


def test_cancelling_a_running_job_stops_it_and_frees_its_kv_blocks(replica, client, ledger):
    job = client.submit(**long_job(1))
    wait_tokens(ledger, job.job_id)
    assert replica_state(replica)["kv_usage"] > 0
    assert job.cancel() is True
    with pytest.raises(JobCancelled):
        job.result(timeout=30)

    rec = ledger.record(job.job_id)
    assert terminal_kinds(rec) == [("cancelled", 1, None)] and rec.status == "cancelled"
    assert rec.events[-1].type == "cancelled", "token events after the terminal event"
    assert 0 < sum(len(e.token_ids) for e in rec.tokens) < LONG
    check_attempt_sequences(rec)
    assert_idle(replica)
    record("cancel of a running job", **ledger.summary([job.job_id]))


def test_cancelling_a_queued_job_means_it_never_runs(replica, client, ledger):
    blockers = hold_both_credits(client, ledger, tag=10)
    target = client.submit(**long_job(12))
    time.sleep(0.2)
    assert target.status().status == "queued" and target.status().attempt == 0, "the target was read"
    assert target.cancel() is True
    release(blockers)
    with pytest.raises(JobCancelled):
        target.result(timeout=30)

    rec = ledger.record(target.job_id)
    assert rec.tokens == [] and terminal_kinds(rec) == [("cancelled", 1, None)]
    assert_idle(replica)
    record("cancel of a queued job", **ledger.summary([target.job_id]))


def test_cancelling_unknown_or_finished_jobs_is_a_no_op(replica, client, ledger):
    unknown = client.job(f"never-submitted-{uuid.uuid4().hex[:8]}")
    assert unknown.cancel() is False
    assert client.redis.exists(client.keys.job(unknown.job_id)) == 0, "cancel created a job hash"

    done = client.submit(**long_job(20, max_tokens=3))
    done.result(timeout=30)
    events_before = ledger.record(done.job_id).events
    assert done.cancel() is False
    time.sleep(0.3)
    rec = ledger.record(done.job_id)
    assert len(rec.events) == len(events_before) and rec.status == "done" and b"cancel" not in rec.hash


# --------------------------------------------------------------------------- deadlines


def test_deadline_passed_before_the_start_fails_the_job_without_running_it(replica, client, ledger):
    already_late = client.submit(**long_job(30, deadline=time.time() - 1))
    with pytest.raises(JobFailed) as failure:
        already_late.result(timeout=30)
    assert failure.value.code == "deadline_exceeded"

    # a job whose deadline passes while it waits in Redis behind two long jobs
    blockers = hold_both_credits(client, ledger, tag=31)
    waiting = client.submit(**long_job(33, deadline=time.time() + 0.5))
    time.sleep(1.0)
    release(blockers)
    with pytest.raises(JobFailed) as failure:
        waiting.result(timeout=30)
    assert failure.value.code == "deadline_exceeded"

    ids = [already_late.job_id, waiting.job_id]
    for rec in ledger.records(ids).values():
        assert rec.tokens == [] and terminal_kinds(rec) == [("error", 1, "deadline_exceeded")]
    assert_idle(replica)
    record("deadline passed before the start", **ledger.summary(ids))


def test_deadline_expiring_while_running_stops_the_job(replica, client, ledger):
    # the deadline falls a third of the way through the job, however fast this CPU runs it
    # (a fixed 0.6 s outlasted the whole job on a fast AVX-512 box)
    full_s = client.submit(**long_job(41, max_tokens=3 * LONG)).result(timeout=60).timings.e2e
    job = client.submit(**long_job(40, max_tokens=3 * LONG, deadline=time.time() + full_s / 3))
    with pytest.raises(JobFailed) as failure:
        job.result(timeout=30)
    assert failure.value.code == "deadline_exceeded"
    rec = ledger.record(job.job_id)
    assert terminal_kinds(rec) == [("error", 1, "deadline_exceeded")]
    assert 0 < sum(len(e.token_ids) for e in rec.tokens) < 3 * LONG, "it should have been stopped while running"
    check_attempt_sequences(rec)
    assert_idle(replica)
    record("deadline expiring while running", **ledger.summary([job.job_id]))


# --------------------------------------------------------------------------- idempotency


def test_same_job_id_and_payload_submitted_twice_runs_once(replica, client, ledger, redis_url, module_namespace):
    spec = {"job_id": f"idem-{uuid.uuid4().hex[:8]}", **long_job(50, max_tokens=40)}
    producers = [Client(redis_url, namespace=module_namespace) for _ in range(2)]
    barrier = threading.Barrier(2)

    def submit(producer):
        barrier.wait()
        return producer.submit(**spec)

    with ThreadPoolExecutor(2) as pool:  # both callers race on the same id
        jobs = list(pool.map(submit, producers))
    results = [job.result(timeout=30) for job in jobs]
    again = producers[0].submit(**spec).result(timeout=30)  # and once more after it finished
    time.sleep(0.5)

    same = [r.model_dump(exclude={"entry_id"}) for r in (*results, again)]
    assert same[0] == same[1] == same[2] and results[0].attempt == 1
    rec = ledger.record(spec["job_id"])
    assert rec.attempt == 1 and terminal_kinds(rec) == [("done", 1, None)]
    assert {e.attempt for e in rec.tokens} == {1}
    check_attempt_sequences(rec)
    record(
        "same job_id + payload submitted 3 times (2 racing)",
        submitted=1,
        **{k: v for k, v in ledger.summary([spec["job_id"]]).items() if k != "submitted"},
        submits=3,
    )


def test_same_job_id_with_a_different_payload_is_a_conflict(replica, client, ledger):
    job_id = f"conflict-{uuid.uuid4().hex[:8]}"
    first = client.submit(job_id=job_id, prompt_token_ids=[5, 6, 7], max_tokens=4, temperature=0)
    with pytest.raises(ConveyorError) as conflict:
        client.submit(job_id=job_id, prompt_token_ids=[9, 9, 9], max_tokens=4, temperature=0)
    assert conflict.value.code == "conflict" and job_id in conflict.value.message
    result = first.result(timeout=30)
    rec = ledger.record(job_id)
    assert rec.attempt == 1 and terminal_kinds(rec) == [("done", 1, None)]
    assert result.usage.prompt_tokens == 3  # the first payload ran, once
    record("same job_id, different payload (conflict)", **ledger.summary([job_id]), rejected_as_conflict=1)


def test_reclaim_racing_the_previous_owners_finish_does_not_run_the_job_again(replica, client, ledger):
    """The race, step by step through ingest's mailbox (where the ledger sends every
    XAUTOCLAIMed entry): the entry is delivered and finished once, then the same entry, as a
    racing XAUTOCLAIM returned it, is sent to ingest again."""
    job = client.submit(**long_job(70, max_tokens=3), model="no-replica-reads-this")
    stream = client.keys.model_requests("no-replica-reads-this", "interactive")
    client.redis.xgroup_create(stream, "engines", id="0")
    [(entry_id, fields)] = client.redis.xreadgroup("engines", "previous-owner", {stream: ">"}, count=1)[0][1]
    ingest = replica.replica.ingest
    entry = ReadEntry(stream, entry_id.decode(), sum(len(k) + len(v) for k, v in fields.items()), False, fields)
    replica.call(ingest.send(Reclaimed(entry)))  # the previous owner's run: attempt 1
    first = job.result(timeout=30)
    assert_idle(replica)  # the previous owner is done with it
    replica.call(ingest.send(Reclaimed(entry)))  # the racing reclaimer's copy of the entry
    time.sleep(1.5)
    assert_idle(replica)
    rec = ledger.record(job.job_id)
    assert first.attempt == 1
    assert terminal_kinds(rec) == [("done", 1, None)], f"the finished job ran again: {terminal_kinds(rec)}"


# --------------------------------------------------------------------------- serve flags


def test_serve_num_kv_blocks_flag_reaches_the_engine_as_an_int(tiny_model):
    from conveyor.actors.cli import _add_engine_options, build_engine

    parser = argparse.ArgumentParser()
    _add_engine_options(parser)
    engine = build_engine(parser.parse_args(["--model", tiny_model, "--num-kv-blocks", "64"]))
    try:
        assert engine.facts.max_pool_tokens == 64 * 16  # 64 blocks of the default 16 tokens
    finally:
        engine.close()
