"""Fault injection, crashes: replicas killed with SIGKILL or frozen with SIGSTOP while they
hold jobs, and healthy replicas running jobs much longer than their lease.

Real `conveyor serve` processes on the session's real Valkey server; the delivery contract
checked from what is left in Redis (every job's out stream and hash)."""

from __future__ import annotations

import datetime
import time

import pytest
from fault_harness import (
    JobLedger,
    check_attempt_sequences,
    pending_owners,
    record,
    spawner_fixture,
    start_all,
    wait_until,
)
from model_factory import build_tiny_model

from conveyor.clients import Client
from conveyor.clients.usage import read_usage

LEASE_S = 2.0


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Still random and tiny, but ~5x the per-token cost of tiny_model: long jobs on CPU."""
    return build_tiny_model(
        "llama",
        tmp_path_factory.mktemp("faults_llama_slow"),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # long jobs: several leases even on a fast CPU
    )


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    """Replica factory; torn down before `namespace` deletes the keys."""
    yield from spawner_fixture(request, tmp_path, redis_url)


def long_job(index: int = 0, max_tokens: int = 900) -> dict:
    return {"prompt_token_ids": [5, 6, 7, 8 + index], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def entry_key(event) -> tuple[int, int]:
    millis, seq = event.entry_id.split("-")
    return int(millis), int(seq)


def server_ms(raw) -> int:
    seconds, micros = raw.time()
    return seconds * 1000 + micros // 1000


def num_tokens(events) -> int:
    return sum(len(e.token_ids) for e in events)


def other(replicas, name):
    return next(r for r in replicas if r.consumer != name)


def owner_of(raw, namespace, replicas):
    owners = set(pending_owners(raw, namespace).values())
    assert len(owners) == 1, f"expected one owner, got {owners}"
    return next(r for r in replicas if r.consumer in owners)


@pytest.mark.slow
def test_kill9_mid_generation_reclaimed_after_lease_and_completed_once(spawn, tiny_model, redis_url, namespace, raw):
    # the production start: the engine core in a child process dies with its SIGKILLed replica
    pair = start_all([spawn(namespace, f"kill-{n}", tiny_model, lease_s=LEASE_S, engine_process=True) for n in "ab"])
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    job = client.submit(**long_job())
    wait_until(lambda: len(ledger.record(job.job_id).tokens) >= 3, 60, "attempt 1 to stream tokens")
    victim = owner_of(raw, namespace, pair)
    survivor = other(pair, victim.consumer)
    entry_id = next(iter(pending_owners(raw, namespace)))
    assert victim.kill9() == -9
    killed_ms = server_ms(raw)
    before = ledger.record(job.job_id)
    assert not before.terminals, "the job finished before the kill: make it longer"

    result = job.result(timeout=90)
    rec = ledger.record(job.job_id)
    assert result.attempt == 2 and rec.attempt == 2 and rec.status == "done"
    assert [(e.type, e.attempt) for e in rec.terminals] == [("done", 2)]
    assert result.token_ids == rec.terminals[0].token_ids and result.text == rec.terminals[0].text
    check_attempt_sequences(rec)
    first, second = rec.tokens_of(1), rec.tokens_of(2)
    assert first and second
    assert max(entry_key(e) for e in first) < min(entry_key(e) for e in second), "attempt 1 wrote after attempt 2"
    assert len(result.token_ids) == 900
    attempt1_ids = [t for e in first for t in e.token_ids]
    assert result.token_ids[: len(attempt1_ids)] == attempt1_ids  # greedy: the same prefix, resumed
    assert survivor.reclaimed_entries() == [entry_id]
    assert survivor.alive()
    today = datetime.datetime.now(datetime.timezone.utc).date()
    [used], _ = read_usage(raw, client.keys, today - datetime.timedelta(days=1), today)
    assert (used.jobs, used.completion_tokens, used.prompt_tokens) == (1, 900, result.usage.prompt_tokens), "once"

    # what a streaming client sees: attempt 1's deltas, then attempt 2 resuming after what it
    # published (actors/resume.py): no reset, every token once (tests/test_resume.py has more)
    streamed = list(client.job(job.job_id).stream(timeout=10))
    assert not any(e.reset for e in streamed)
    [resumed] = [e for e in streamed if e.resumed_tokens is not None]
    assert resumed.attempt == 2 and resumed.seq == 0 and resumed.resumed_tokens == result.resumed_tokens > 0
    text, ids = "", []
    for event in streamed:
        text, ids, _ = event.carried_over(text, ids)
        text, ids = text + event.text, ids + event.token_ids
    assert (text, ids) == (result.text, result.token_ids)
    restarted_after_s = (entry_key(second[0])[0] - killed_ms) / 1000  # both on the server's clock
    record(
        "kill -9 of the replica running the job",
        **ledger.summary([job.job_id]),
        attempts=rec.attempt,
        restarted_after_s=round(restarted_after_s, 1),
    )


@pytest.mark.slow
def test_healthy_jobs_longer_than_the_lease_are_never_reclaimed(spawn, slow_model, redis_url, namespace, raw):
    """Lease 1 s; each replica runs one sequence at a time and holds a second one waiting,
    so jobs stay leased for several leases. Their owners renew: nobody reclaims anything."""
    lease_s = 1.0
    pair = start_all(
        [spawn(namespace, f"long-{n}", slow_model, lease_s=lease_s, args=["--max-num-seqs", "1"]) for n in "ab"]
    )
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    # 800 tokens: ~10 s a job on a 2-core AVX2 EPYC, so several leases on a CPU 3x as fast
    jobs = client.submit_many([long_job(i, max_tokens=800) for i in range(4)], progress=False)
    results = [job.result(timeout=180) for job in jobs]

    records = ledger.records([job.job_id for job in jobs])
    for rec in records.values():
        assert rec.attempt == 1 and [(e.type, e.attempt) for e in rec.terminals] == [("done", 1)]
        assert {e.attempt for e in rec.tokens} == {1}
        check_attempt_sequences(rec)
    assert all(r.attempt == 1 and len(r.token_ids) == 800 for r in results)
    for replica in pair:
        assert replica.reclaimed_entries() == [], f"{replica.consumer} reclaimed a healthy job"
        assert replica.alive()
    e2e = sorted(r.timings.e2e for r in results)
    assert e2e[-1] >= 4 * lease_s, f"jobs too short to mean anything: e2e {e2e}"
    record(
        "jobs leased for several leases (healthy, slow)",
        **ledger.summary([j.job_id for j in jobs]),
        lease_s=lease_s,
        longest_job_s=round(e2e[-1], 1),
    )


@pytest.mark.slow
def test_orphans_of_a_killed_replica_taken_once_by_three_reclaiming_survivors(
    spawn, tiny_model, redis_url, namespace, raw
):
    victim = spawn(namespace, "orphan-victim", tiny_model, lease_s=LEASE_S).start().wait_ready()
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    jobs = client.submit_many([long_job(i, max_tokens=600) for i in range(9)], progress=False)
    ids = [job.job_id for job in jobs]
    wait_until(lambda: all(r.tokens for r in ledger.records(ids).values()), 60, "the victim to run all 9 jobs")
    orphans = pending_owners(raw, namespace)
    assert len(orphans) == 9 and set(orphans.values()) == {victim.consumer}
    victim.kill9()
    assert not any(r.terminals for r in ledger.records(ids).values()), "a job finished before the kill"

    # One sequence and two credits each: none of them can take every orphan in one go.
    survivors = start_all(
        [spawn(namespace, f"survivor-{n}", tiny_model, lease_s=LEASE_S, args=["--max-num-seqs", "1"]) for n in range(3)]
    )
    ledger.wait_finished(ids, 180, "orphans")

    taken = [entry for s in survivors for entry in s.reclaimed_entries()]
    assert sorted(taken) == sorted(orphans), "every orphan reclaimed exactly once, by exactly one survivor"
    reclaimers = {s.consumer for s in survivors if s.reclaimed_entries()}
    assert len(reclaimers) >= 2, f"the reclaims did not race: only {reclaimers} took orphans"
    for rec in ledger.records(ids).values():
        assert rec.attempt == 2 and [(e.type, e.attempt) for e in rec.terminals] == [("done", 2)]
        check_attempt_sequences(rec)
    assert all(s.alive() for s in survivors)
    summary = ledger.summary(ids)
    record(
        "kill -9 with 9 jobs in flight, 3 survivors reclaiming",
        **summary,
        taken_per_survivor=[len(s.reclaimed_entries()) for s in survivors],
    )
    assert summary["lost"] == 0 and summary["duplicates"] == 0


@pytest.mark.slow
def test_stale_owner_resuming_after_a_pause_cannot_overwrite_the_new_result(
    spawn, tiny_model, redis_url, namespace, raw
):
    """SIGSTOP the owner past its lease (a frozen VM, a long GC pause): the job is reclaimed and
    rerun as attempt 2. The old owner then wakes up and finishes attempt 1: fenced off."""
    pair = start_all([spawn(namespace, f"pause-{n}", tiny_model, lease_s=LEASE_S) for n in "ab"])
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    job = client.submit(**long_job(max_tokens=900))
    wait_until(lambda: len(ledger.record(job.job_id).tokens) >= 3, 60, "attempt 1 to stream tokens")
    stale = owner_of(raw, namespace, pair)
    stale.pause()
    try:
        wait_until(lambda: len(ledger.record(job.job_id).tokens_of(2)) >= 3, 60, "attempt 2 on the other replica")
    finally:
        stale.resume()
    # the old owner runs attempt 1 to its end (900 tokens) and then tries to publish its result
    wait_until(lambda: num_tokens(ledger.record(job.job_id).tokens_of(1)) == 900, 90, "the stale attempt to end")
    result = job.result(timeout=90)
    time.sleep(1.0)  # the stale owner's fenced finish comes right after its last token event
    rec = ledger.record(job.job_id)
    assert result.attempt == 2
    assert [(e.type, e.attempt) for e in rec.terminals] == [("done", 2)], "the stale owner published a result"
    assert rec.hash[b"finished_attempt"] == b"2" and rec.attempt == 2
    check_attempt_sequences(rec)
    assert all(r.alive() for r in pair)
    record("SIGSTOP of the owner past its lease, then SIGCONT (stale owner)", **ledger.summary([job.job_id]))


@pytest.mark.slow
def test_intake_slower_than_the_lease_does_not_reclaim_its_own_entries(spawn, tiny_model, redis_url, namespace, raw):
    replica = spawn(namespace, "slow-intake", tiny_model, lease_s=1.0).start().wait_ready()
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    # 66 KB prompts: ~50 ms of tokenization each, so a 128-entry read takes seconds to accept,
    # several leases (they then fail fast: longer than max_model_len)
    jobs = client.submit_many(
        [{"prompt": f"x = {i} + y\n" * 6000, "max_tokens": 1} for i in range(200)], progress=False
    )
    ids = [job.job_id for job in jobs]
    wait_until(
        lambda: not replica.alive() or all(s in ("done", "error") for s in ledger.statuses(ids)), 120, "the jobs to end"
    )
    time.sleep(1.0)
    assert replica.alive(), f"the replica crashed:\n{replica.log_tail(1500)}"
    summary = ledger.summary(ids)
    assert summary["duplicates"] == 0 and summary["lost"] == 0, summary
    assert replica.reclaimed_entries() == [], "the replica reclaimed entries it was still taking in"
    record("intake of a batch slower than the lease (long prompts)", **summary, lease_s=1.0)
