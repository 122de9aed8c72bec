"""Sync and async clients, CLI and embedded server against a real Valkey/Redis server.

The engine side is played by hand: tests write events on `<ns>:out:<job_id>` with the
protocol's own encoder and check what the clients make of them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from conveyor import cli as conveyor_cli
from conveyor.clients import (
    AsyncClient,
    CancelledEvent,
    Client,
    DoneEvent,
    ErrorEvent,
    InvalidJob,
    JobCancelled,
    JobFailed,
    QueueFull,
    Timeout,
    TokenEvent,
    cli,
    decode_job,
    encode_event,
)
from conveyor.clients.connection import ASYNC_POOL_SIZE, RedisSettings
from conveyor.clients.protocol import encode_event_data


@pytest.fixture
def client(redis_url, namespace):
    with Client(redis_url, namespace) as c:
        yield c


def token(seq: int, text: str, attempt: int = 1) -> TokenEvent:
    return TokenEvent(attempt=attempt, seq=seq, text=text, token_ids=[100 + seq])


def done(text: str, attempt: int = 1, seq: int = 0, **extra) -> DoneEvent:
    return DoneEvent(
        attempt=attempt,
        seq=seq,
        finish_reason="stop",
        text=text,
        token_ids=[1, 2],
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        timings={"queue": 0.1, "ttft": 0.2, "tpot": 0.01, "e2e": 0.3},
        **extra,
    )


def publish(client: Client, job_id: str, *events) -> list[str]:
    return [client.redis.xadd(client.keys.out(job_id), encode_event(e)).decode() for e in events]


def finish_in_hash(client: Client, job_id: str, event) -> None:
    client.redis.hset(client.keys.job(job_id), mapping={"status": event.type, "result": encode_event_data(event)})


# ---------------------------------------------------------------- submit


@pytest.mark.parametrize("priority_class", ["interactive", "batch"])
def test_submit_writes_decodable_entry_and_job_hash_with_ttl(client, priority_class):
    job = client.submit("Hello", max_tokens=5, priority_class=priority_class, result_ttl=600, metadata={"k": 1})
    entries = client.redis.xrange(client.keys.requests(priority_class))
    assert len(entries) == 1
    request = decode_job(entries[0][1])
    assert (request.job_id, request.prompt, request.max_tokens, request.metadata) == (job.job_id, "Hello", 5, {"k": 1})
    other = "batch" if priority_class == "interactive" else "interactive"
    assert client.redis.xlen(client.keys.requests(other)) == 0
    job_hash = client.redis.hgetall(client.keys.job(job.job_id))
    assert job_hash[b"status"] == b"queued" and job_hash[b"attempt"] == b"0"
    assert abs(float(job_hash[b"updated"]) - time.time()) < 5
    assert 590 < client.redis.ttl(client.keys.job(job.job_id)) <= 600
    status = job.status()
    assert (status.status, status.attempt, status.cancel_requested) == ("queued", 0, False)


def test_submit_messages_and_token_ids(client):
    chat = client.submit(messages=[{"role": "user", "content": "Hi"}], job_id="chat-1")
    ids = client.submit(prompt_token_ids=[1, 2, 3])
    requests = [decode_job(fields) for _, fields in client.redis.xrange(client.keys.interactive)]
    assert [r.job_id for r in requests] == [chat.job_id, ids.job_id]
    assert requests[0].messages[0].content == "Hi" and requests[1].prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({}, "prompt"),
        ({"prompt": "x", "max_token": 5}, "max_token"),  # typo: unknown kwargs are errors here
    ],
)
def test_invalid_submit_raises_before_writing(client, kwargs, field):
    with pytest.raises(InvalidJob) as info:
        client.submit(**kwargs)
    assert info.value.field == field and field in str(info.value)
    assert client.redis.xlen(client.keys.interactive) == 0
    assert not list(client.redis.scan_iter(match=f"{client.keys.ns}:*"))


def test_unknown_kwarg_suggests_the_right_name(client):
    with pytest.raises(InvalidJob, match="did you mean 'max_tokens'"):
        client.submit("x", max_token=5)


def test_submit_is_idempotent_per_job_id(client):
    from conveyor.clients import JobConflict

    first = client.submit("x", job_id="same")
    second = client.submit("x", job_id="same")
    assert first.job_id == second.job_id == "same" and first.enqueued and not second.enqueued
    with pytest.raises(JobConflict):
        client.submit("y", job_id="same")
    assert client.redis.xlen(client.keys.interactive) == 1


def test_max_queue_len_raises_queue_full(client):
    client.submit("a", max_queue_len=2)
    client.submit("b", max_queue_len=2)
    with pytest.raises(QueueFull):
        client.submit("c", max_queue_len=2)
    assert client.redis.xlen(client.keys.interactive) == 2


def test_submit_many_pipelines_and_validates_everything_first(client):
    items = [{"prompt": f"p{i}", "priority_class": "batch" if i % 2 else "interactive"} for i in range(7)]
    jobs = client.submit_many(items, progress=False)
    assert len(jobs) == 7
    assert (client.redis.xlen(client.keys.interactive), client.redis.xlen(client.keys.batch)) == (4, 3)
    with pytest.raises(InvalidJob, match=r"jobs\[1\]: .*top_p"):
        client.submit_many([{"prompt": "ok"}, {"prompt": "bad", "top_p": 2}], progress=False)
    assert client.redis.xlen(client.keys.interactive) == 4


def test_submit_many_queue_full_reports_what_was_enqueued(client):
    with pytest.raises(QueueFull) as info:
        client.submit_many([{"prompt": str(i)} for i in range(5)], progress=False, max_queue_len=3)
    assert len(info.value.submitted) == 3


# ---------------------------------------------------------------- stream and result


def test_stream_and_result_from_hand_written_events(client):
    job = client.submit("Hi", job_id="s1", metadata={"m": 1})
    ids = publish(client, "s1", token(0, "He"), token(1, "llo"), done("Hello", seq=2, metadata={"m": 1}))
    events = list(job.stream())
    assert [e.text for e in events] == ["He", "llo"]
    assert [e.entry_id for e in events] == ids[:2]
    assert [e.reset for e in events] == [False, False]
    result = job.result()
    assert (result.text, result.finish_reason, result.token_ids, result.metadata) == ("Hello", "stop", [1, 2], {"m": 1})
    assert result.usage.total_tokens == 5 and result.timings.ttft == 0.2
    assert result.entry_id == ids[2]


def test_stream_blocks_until_events_arrive(client):
    job = client.submit("Hi")

    def engine():
        time.sleep(0.15)
        publish(client, job.job_id, token(0, "a"))
        time.sleep(0.1)
        publish(client, job.job_id, token(1, "b"), done("ab", seq=2))

    thread = threading.Thread(target=engine)
    thread.start()
    assert "".join(e.text for e in job.stream(timeout=5)) == "ab"
    thread.join()
    assert job.result(timeout=0.1).text == "ab"


def test_stream_resumes_from_entry_id(client):
    job = client.submit("Hi")
    ids = publish(client, job.job_id, token(0, "a"), token(1, "b"), token(2, "c"), done("abc", seq=3))
    resumed = client.job(job.job_id).stream(from_id=ids[0])
    assert [e.text for e in resumed] == ["b", "c"]


def test_attempt_change_is_surfaced_and_stale_events_dropped(client):
    job = client.submit("Hi")
    publish(
        client,
        job.job_id,
        token(0, "x", attempt=1),
        token(1, "y", attempt=1),
        token(0, "A", attempt=2),
        token(2, "stale", attempt=1),  # the crashed owner's late write
        token(0, "A", attempt=2),  # duplicate write
        token(1, "B", attempt=2),
        ErrorEvent(attempt=1, code="stale", message="fenced"),
        done("AB", attempt=2, seq=2),
    )
    events = list(job.stream())
    assert [(e.attempt, e.seq, e.text, e.reset) for e in events] == [
        (1, 0, "x", False),
        (1, 1, "y", False),
        (2, 0, "A", True),
        (2, 1, "B", False),
    ]
    assert job.result().attempt == 2


def test_error_event_raises_job_failed(client):
    job = client.submit("Hi")
    publish(client, job.job_id, token(0, "a"), ErrorEvent(attempt=1, code="prompt_too_long", message="limit 8"))
    seen = []
    with pytest.raises(JobFailed) as info:
        for event in job.stream():
            seen.append(event.text)
    assert seen == ["a"]
    assert (info.value.code, info.value.reason) == ("prompt_too_long", "limit 8")
    with pytest.raises(JobFailed, match="prompt_too_long"):
        client.job(job.job_id).result()


def test_cancelled_event_raises_job_cancelled(client):
    job = client.submit("Hi")
    publish(client, job.job_id, CancelledEvent(attempt=1))
    with pytest.raises(JobCancelled):
        list(job.stream())
    with pytest.raises(JobFailed):  # JobCancelled is a JobFailed
        client.job(job.job_id).result()


def test_timeouts(client):
    job = client.submit("Hi")
    started = time.monotonic()
    with pytest.raises(Timeout):
        job.result(timeout=0.2)
    with pytest.raises(TimeoutError):  # Timeout is also the builtin TimeoutError
        list(job.stream(timeout=0.2))
    assert time.monotonic() - started < 2


def test_result_reads_terminal_event_from_job_hash(client):
    job = client.submit("Hi")
    finish_in_hash(client, job.job_id, done("from hash"))
    assert job.result(timeout=0.1).text == "from hash"
    assert job.status().status == "done"


# ---------------------------------------------------------------- cancel


def test_cancel_flags_hash_and_publishes(client):
    job = client.submit("Hi")
    pubsub = client.redis.pubsub()
    pubsub.subscribe(client.keys.cancel)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    assert job.cancel() is True
    message = pubsub.get_message(timeout=1)
    pubsub.close()
    assert message["data"] == job.job_id.encode()
    assert job.status().cancel_requested


def test_cancel_is_a_noop_for_unknown_and_finished_jobs(client):
    assert client.job("never-submitted").cancel() is False
    assert not client.redis.exists(client.keys.job("never-submitted"))
    job = client.submit("Hi")
    finish_in_hash(client, job.job_id, done("x"))
    assert job.cancel() is False and not job.status().cancel_requested
    assert client.job("never-submitted").status().status == "unknown"


# ---------------------------------------------------------------- async


def test_async_client_end_to_end(redis_url, namespace):
    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            job = await client.submit("Hi", job_id="a1", priority_class="batch")
            assert await client.redis.xlen(client.keys.batch) == 1
            assert 0 < await client.redis.ttl(client.keys.job("a1")) <= 86400

            async def engine():
                await asyncio.sleep(0.1)
                for event in (token(0, "x"), token(0, "A", attempt=2), token(1, "B", attempt=2), done("AB", 2, 2)):
                    await client.redis.xadd(client.keys.out("a1"), encode_event(event))

            writer = asyncio.create_task(engine())
            events = [e async for e in job.stream(timeout=5)]
            await writer
            assert [(e.text, e.reset) for e in events] == [("x", False), ("A", True), ("B", False)]
            assert (await job.result()).text == "AB"
            resumed = [e.text async for e in client.job("a1").stream(from_id=events[1].entry_id)]
            assert resumed == ["B"]
            assert (await job.status()).status == "queued"
            assert len(await client.submit_many([{"prompt": "p"}] * 3, progress=False)) == 3

    asyncio.run(scenario())


def test_async_failures_timeout_and_cancel(redis_url, namespace):
    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            with pytest.raises(InvalidJob):
                await client.submit("x", top_p=0)
            failing = await client.submit("Hi")
            await client.redis.xadd(
                client.keys.out(failing.job_id), encode_event(ErrorEvent(attempt=1, code="oom", message="no blocks"))
            )
            with pytest.raises(JobFailed, match="oom"):
                await failing.result(timeout=1)
            slow = await client.submit("Hi")
            with pytest.raises(Timeout):
                await slow.result(timeout=0.2)
            with pytest.raises(Timeout):
                [e async for e in slow.stream(timeout=0.2)]
            assert await slow.cancel() is True
            assert (await slow.status()).cancel_requested
            assert await client.job("nope").cancel() is False
            status = await client.queue_status()
            assert status["requests"]["interactive"]["length"] == 2

    asyncio.run(scenario())


# ---------------------------------------------------------------- queue status and CLI


def test_queue_status_reports_group_consumers_and_dead_letters(client):
    client.submit("a")
    client.submit("b", priority_class="batch")
    client.redis.xgroup_create(client.keys.interactive, "engines", id="0")
    client.redis.xreadgroup("engines", "replica-1", {client.keys.interactive: ">"}, count=1)
    client.redis.xadd(client.keys.dead, {"reason": "poison"})
    status = client.queue_status()
    interactive, batch = status["requests"]["interactive"], status["requests"]["batch"]
    assert (interactive["length"], interactive["pending"], interactive["group"]) == (1, 1, True)
    assert [c["name"] for c in interactive["consumers"]] == ["replica-1"]
    assert (batch["length"], batch["group"], batch["consumers"]) == (1, False, [])
    assert status["dead_letter"]["length"] == 1
    assert "replica-1" in cli.format_status(status)


def test_cli_submit_status_and_file(redis_url, namespace, client, capsys, tmp_path):
    base = ["--redis-url", redis_url, "--namespace", namespace]
    assert conveyor_cli.main(["submit", "Hello", "--max-tokens", "3", "--stop", "x", "--no-wait", *base]) == 0
    job_id = capsys.readouterr().out.strip()
    request = decode_job(client.redis.xrange(client.keys.interactive)[0][1])
    assert (request.job_id, request.max_tokens, request.stop) == (job_id, 3, ["x"])

    assert conveyor_cli.main(["submit", "Hi", "--top-p", "7", *base]) == 2
    assert "top_p" in capsys.readouterr().err

    jobs_file = tmp_path / "jobs.jsonl"
    jobs_file.write_text('{"prompt": "one", "job_id": "f1"}\n\n{"prompt": "two", "job_id": "f2"}\n')
    finish_in_hash(client, "f1", done("ONE"))
    publish(client, "f2", ErrorEvent(attempt=1, code="boom", message="bad"))
    # f1/f2 are finished before submission, so submit is a no-op for them (idempotent).
    client.redis.hset(client.keys.job("f2"), "status", "running")
    assert conveyor_cli.main(["submit", "--file", str(jobs_file), "--quiet", "--timeout", "2", *base]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["text"] == "ONE" and lines[1]["error"]["code"] == "boom"

    assert conveyor_cli.main(["status", "--json", *base]) == 0
    assert json.loads(capsys.readouterr().out)["requests"]["interactive"]["length"] == 1


def test_cli_streams_tokens(redis_url, namespace, client, capsys):
    def engine():
        for _ in range(100):
            entries = client.redis.xrange(client.keys.interactive)
            if entries:
                job_id = decode_job(entries[0][1]).job_id
                publish(client, job_id, token(0, "Hel"), token(1, "lo"), done("Hello", seq=2))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=engine)
    thread.start()
    code = conveyor_cli.main(
        ["submit", "Hi", "--stream", "--timeout", "5", "--redis-url", redis_url, "--namespace", namespace]
    )
    thread.join()
    assert code == 0 and capsys.readouterr().out == "Hello\n"


def test_clients_import_without_heavy_packages():
    code = (
        "import sys, conveyor.clients, conveyor.clients.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.split('.')[:2] in (['conveyor', 'engine'], ['conveyor', 'actors'], ['conveyor', 'kernels'])]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=str(_repo_root())).returncode == 0


def _repo_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- embedded server


def test_embedded_valkey_restart_keeps_data_and_port(tmp_path):
    from conveyor.actors.embedded_valkey import EmbeddedValkey

    with EmbeddedValkey(tmp_path / "data") as server:
        url = server.url
        conn = server.settings.client()
        conn.xadd("s", {"a": "1"})
        conn.close()
        server.restart()
        assert server.url == url
        conn = server.settings.client()
        assert conn.xlen("s") == 1
        conn.close()
    assert not server.is_running()
    assert any((tmp_path / "data").glob("appendonlydir/*"))


def test_an_async_client_waits_for_a_free_connection_past_redis_pys_pool_size(redis_url):
    """redis-py 8's pools hold 100 connections and raise past that; a gateway under load has
    more commands in the air (CI once saw MaxConnectionsError cancel a batch's jobs)."""

    async def scenario():
        client = RedisSettings(url=redis_url).async_client()
        try:  # each BLPOP holds its connection for 0.2 s: 2x the pool in the air at once
            replies = await asyncio.gather(*(client.blpop([f"pool-test-{i}"], 0.2) for i in range(2 * ASYNC_POOL_SIZE)))
        finally:
            await client.aclose()
        return replies

    assert asyncio.run(scenario()) == [None] * (2 * ASYNC_POOL_SIZE)
