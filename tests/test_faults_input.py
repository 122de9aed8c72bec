"""Fault injection, the input: hostile entries written straight into the request stream
(fuzzed with hypothesis), and a flood of 5,000 jobs against a bounded producer.

Both run a real `conveyor serve` process: "never crashes" means the same PID is still
serving at the end, and "the queue lives in Redis" is measured on that process's RSS."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time

import msgpack
import pytest
import redis
from fault_harness import JobLedger, check_attempt_sequences, record, spawner_fixture, wait_until
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conveyor.clients import Client
from conveyor.clients.errors import ProtocolError, QueueFull
from conveyor.clients.keys import Keys
from conveyor.clients.protocol import JobRequest, decode_job

MB = 1024 * 1024


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    yield from spawner_fixture(
        request, tmp_path, redis_url, engine_process=True
    )  # the flood: core and front door in parallel


# --------------------------------------------------------------------------- hostile entries

GOOD = {"prompt": "def main():", "max_tokens": 3, "temperature": 0}
FIELDS = sorted(JobRequest.model_fields) + ["v", "colour"]
_ids = itertools.count()

hostile_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -1, -1.5, 0, -0.0, 2**31, 2**63 - 1, -(2**63), 1e308]),
)
hostile_values = st.recursive(
    hostile_scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=25,
)
huge_strings = st.builds(
    lambda n, ch: ch * n, st.integers(100_000, 1_100_000), st.sampled_from(["x", "é", "\x00", "🙂", "{", " "])
)


def unique_job_id(payload: dict) -> dict:
    """Well-formed job ids are made unique (one job per entry); hostile ones are kept."""
    job_id = payload.get("job_id")
    if isinstance(job_id, str) and 0 < len(job_id) <= 128 and all(c.isalnum() or c in "_.:-" for c in job_id):
        payload["job_id"] = f"fz-{next(_ids)}"
    return payload


def runnable(payload: dict) -> dict:
    """A payload that turns out valid must stay short (a random model may never stop) and
    keep its results long enough to be counted."""
    try:
        job = JobRequest.model_validate(payload)
    except Exception:
        return payload
    payload["max_tokens"] = min(job.max_tokens, 4)
    payload["min_tokens"] = min(job.min_tokens, payload["max_tokens"])
    payload["result_ttl"] = max(job.result_ttl, 3600)
    return payload


def encode(payload, as_json: bool) -> dict:
    if as_json:
        try:
            return {"json": json.dumps(payload, allow_nan=True)}  # NaN/Infinity on purpose
        except (TypeError, ValueError):
            pass
    return {"data": msgpack.packb(payload, use_bin_type=True)}


mutated_jobs = st.builds(
    lambda name, value, as_json: encode(runnable(unique_job_id({**GOOD, "job_id": "x", name: value})), as_json),
    st.sampled_from(FIELDS),
    hostile_values | huge_strings,
    st.booleans(),
)
random_maps = st.builds(
    lambda payload, as_json: encode(runnable(unique_job_id(payload)), as_json),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), hostile_values, max_size=8),
    st.booleans(),
)
entries = st.one_of(
    mutated_jobs,
    mutated_jobs,
    random_maps,
    st.binary(max_size=3000).map(lambda b: {"data": b}),
    st.binary(max_size=3000).map(lambda b: {"json": b}),
    st.text(max_size=300).map(lambda t: {"json": t}),
    st.dictionaries(
        st.text(min_size=1, max_size=10).filter(lambda k: k not in ("data", "json")),
        st.binary(max_size=50),
        min_size=1,
        max_size=3,
    ),
    hostile_values.map(lambda v: {"data": msgpack.packb(v, use_bin_type=True)}),  # not a map
)


def fixed_hostile_entries() -> list[dict]:
    """The cases the issue names, always included."""
    ten_mb = "A" * (10 * MB)
    return [
        {"data": msgpack.packb({"job_id": "fx-10mb-data", "prompt": ten_mb})},
        {"json": json.dumps({"job_id": "fx-10mb-json", "prompt": ten_mb})},
        {"data": msgpack.packb({"job_id": "fx-limit-prompt", "prompt": "x" * 1_000_000, "max_tokens": 2})},
        {"data": msgpack.packb({"job_id": "fx-many-ids", "prompt_token_ids": [7] * 262_144, "max_tokens": 2})},
        {"data": msgpack.packb({"job_id": "fx-big-ids", "prompt_token_ids": [2**31 - 1, 10**6], "max_tokens": 2})},
        {"data": msgpack.packb({**GOOD, "job_id": "fx-nan", "temperature": math.nan})},
        {"json": '{"job_id": "fx-inf", "prompt": "hi", "top_p": -Infinity}'},
        {"data": msgpack.packb({**GOOD, "job_id": "fx-negative", "max_tokens": -5, "top_k": -7})},
        {"data": msgpack.packb({**GOOD, "job_id": "fx-types", "max_tokens": "5", "stop": {"a": 1}})},
        {
            "data": msgpack.packb({"job_id": "fx-deep"})[: -0 or None].replace(b"\x81", b"\x82", 1)
            + b"\xa6prompt"
            + b"\x91" * 5000
            + b"\x90"
        },  # arrays nested 5,000 deep
        {"data": msgpack.packb([[]] * 300_000)},
        {"data": b"\xc1" * 64},
        {"data": msgpack.packb({**GOOD, "job_id": "fx-seed", "seed": -1})},
        {"data": msgpack.packb({**GOOD, "job_id": "fx-version", "v": 99})},
        {"data": msgpack.packb({**GOOD, "job_id": "fx-metadata", "metadata": {"k": "v" * 70_000}})},
        {
            "json": json.dumps(
                {**GOOD, "job_id": "fx-messages", "prompt": None, "messages": [{"role": "user", "content": 5}]}
            )
        },
    ]


def expected_job_id(fields: dict, entry_id: str) -> tuple[str | None, bool]:
    """(the job id the replica will answer to, whether the entry is valid), as the replica decodes it."""
    try:
        return decode_job(fields, entry_id).job_id, True
    except ProtocolError as exc:
        return exc.job_id, False


@pytest.mark.slow
def test_fuzzed_hostile_entries_never_crash_the_replica_and_each_gets_an_answer(
    spawn, tiny_model, redis_url, namespace, raw
):
    replica = spawn(namespace, "fuzz", tiny_model, lease_s=10).start().wait_ready()
    pid, stream = replica.pid, Keys(namespace).interactive
    written: list[tuple[str, dict]] = []

    def xadd(fields: dict) -> None:
        written.append((raw.xadd(stream, fields).decode(), fields))

    @settings(
        max_examples=100, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @given(entries)
    def feed(fields):
        xadd(fields)

    for fields in fixed_hostile_entries():
        xadd(fields)
    feed()
    wait_until(lambda: raw.xlen(stream) == 0, 180, "every hostile entry to be answered and removed")
    assert replica.alive() and replica.pid == pid, f"the replica died:\n{replica.log_tail()}"

    ledger = JobLedger(raw, namespace)
    dead_by_entry = {_text(d["entry_id"]): d for d in ledger.dead_letters()}
    expectations = [(entry_id, *expected_job_id(fields, entry_id)) for entry_id, fields in written]
    records = ledger.records([job_id for _, job_id, _ in expectations if job_id])
    counts = {"done": 0, "error": 0, "dead_letter": 0}
    unanswered, duplicates = [], 0
    for entry_id, job_id, valid in expectations:
        rec = records.get(job_id)
        answered = (rec is not None and len(rec.terminals) >= 1) if job_id else False
        dead = entry_id in dead_by_entry
        if (job_id and not answered) or (not valid and not dead) or (valid and dead):
            unanswered.append((entry_id, job_id, valid, dead, _short(dict(written)[entry_id])))
        if rec is not None:
            duplicates += max(0, len(rec.terminals) - 1)
            for event in rec.terminals[:1]:
                counts[event.type] = counts.get(event.type, 0) + 1
            check_attempt_sequences(rec)
        counts["dead_letter"] += dead
    assert not unanswered, f"{len(unanswered)} entries without their answer: {unanswered[:5]}"
    assert all(d["reason"] for d in dead_by_entry.values())
    assert records["fx-10mb-data"].terminals[0].code == "too_large"

    good = Client(redis_url, namespace=namespace).submit(prompt="def main():", max_tokens=4, temperature=0)
    assert good.result(timeout=60).token_ids
    assert replica.alive() and replica.pid == pid
    assert "crashed" not in replica.log_text() and "Traceback" not in replica.log_text()
    record(
        "hostile entries (hypothesis fuzz + 10 MB payloads)",
        submitted=len(written) + 1,
        completed=len(written) + 1 - len(unanswered),
        lost=len(unanswered),
        duplicates=duplicates,
        **{f"{k}s": v for k, v in counts.items()},
    )


def _short(fields: dict) -> dict:
    return {k: (v[:60] if isinstance(v, (bytes, str)) else v) for k, v in fields.items()}


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


# --------------------------------------------------------------------------- flood


class Sampler(threading.Thread):
    """Samples the replica's RSS, the stream length and the group's pending count."""

    def __init__(self, replica, redis_url: str, stream: str) -> None:
        super().__init__(daemon=True)
        self.replica, self.stream = replica, stream
        self.redis = redis.Redis.from_url(redis_url)
        self.peak_rss = self.max_len = self.max_pending = 0
        self.running = True

    def run(self) -> None:
        while self.running:
            self.peak_rss = max(self.peak_rss, self.replica.rss_bytes())
            self.max_len = max(self.max_len, self.redis.xlen(self.stream))
            self.max_pending = max(self.max_pending, self.redis.xpending(self.stream, "engines")["pending"])
            time.sleep(0.05)

    def finish(self) -> Sampler:
        self.running = False
        self.join(5)
        self.redis.close()
        return self


def tiny_jobs(count: int, offset: int) -> list[dict]:
    return [
        {"prompt_token_ids": [5 + (offset + i) % 700, 6, 7], "max_tokens": 1, "temperature": 0} for i in range(count)
    ]


@pytest.mark.slow
def test_flood_of_5000_jobs_waits_in_redis_and_every_accepted_job_completes(
    spawn, tiny_model, redis_url, namespace, raw
):
    client, ledger, stream = (
        Client(redis_url, namespace=namespace),
        JobLedger(raw, namespace),
        Keys(namespace).interactive,
    )
    # a bounded producer, before any replica runs: 100 accepted, then QueueFull
    with pytest.raises(QueueFull) as full:
        client.submit_many(tiny_jobs(150, 0), max_queue_len=100, progress=False)
    first = full.value.submitted
    assert len(first) == 100 and raw.xlen(stream) == 100
    with pytest.raises(QueueFull):
        client.submit(prompt="one more", max_queue_len=100)

    replica = spawn(namespace, "flood", tiny_model, lease_s=10).start()
    sampler = Sampler(replica, redis_url, stream)
    replica.wait_ready()
    sampler.start()
    ledger.wait_finished([j.job_id for j in first], 60, "the first 100 jobs")
    small = sampler.finish()

    sampler = Sampler(replica, redis_url, stream)
    sampler.start()
    flood = client.submit_many(tiny_jobs(5000, 100), max_queue_len=5000, progress=False)
    queued_now = raw.xlen(stream)
    with pytest.raises(QueueFull):  # past the bound while the flood is queued
        client.submit(prompt="over the limit", max_queue_len=min(queued_now, 1000))
    ids = [j.job_id for j in first + flood]
    started = time.monotonic()
    wait_until(lambda: raw.xlen(stream) == 0, 180, "the flood to drain", interval=0.25)  # acked after the result
    drain_s = time.monotonic() - started
    big = sampler.finish()

    capacity = 2 * 64  # credits: 2 x max_num_seqs (default 64)
    growth_mb = (big.peak_rss - small.peak_rss) / MB
    summary = ledger.summary(ids)
    for rec in ledger.records(ids[:200] + ids[-200:]).values():
        assert [e.type for e in rec.terminals] == ["done"]
        check_attempt_sequences(rec)
    assert summary["lost"] == 0 and summary["duplicates"] == 0
    assert ledger.statuses(ids).count("done") == len(ids)
    assert big.max_len >= 2000, f"the flood never queued up in Redis (max XLEN {big.max_len})"
    assert big.max_pending <= capacity, f"{big.max_pending} entries read at once; credits are {capacity}"
    assert growth_mb < 50, f"RSS grew {growth_mb:.0f} MB between 100 and 5,000 queued jobs"
    assert replica.alive()
    record(
        "flood of 5,000 jobs + bounded producer",
        **summary,
        rejected_queue_full=52,
        max_queued=big.max_len,
        max_in_flight=big.max_pending,
        drain_s=round(drain_s),
        rss_mb_100_queued=round(small.peak_rss / MB),
        rss_mb_5000_queued=round(big.peak_rss / MB),
    )
