"""Dead letters: parked with the reason and the original fields, listed, and requeued."""

import json
import time

import pytest
import redis
from model_factory import build_tiny_model
from replica_harness import ReplicaThread

from conveyor.clients import Client, JobFailed
from conveyor.clients.dead_letters import list_dead, requeue
from conveyor.clients.keys import Keys


def wait_for_status(raw, key, status, timeout=30.0):
    deadline = time.time() + timeout
    while raw.hget(key, "status") != status and time.time() < deadline:
        time.sleep(0.05)
    return raw.hget(key, "status")


def test_job_parked_after_max_deliveries_can_be_requeued(tmp_path, redis_url, namespace):
    model = build_tiny_model("llama", tmp_path / "llama")
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    # as if three replicas had already died running it
    raw.hset(keys.job("unlucky"), mapping={"attempt": 3, "status": "queued"})
    raw.expire(keys.job("unlucky"), 600)
    raw.xadd(
        keys.batch,
        {
            "json": json.dumps(
                {
                    "job_id": "unlucky",
                    "prompt": "def f():",
                    "max_tokens": 4,
                    "temperature": 0,
                    "priority_class": "batch",
                }
            )
        },
    )
    with ReplicaThread(model, redis_url, namespace, max_num_seqs=4) as running:
        running.config.max_deliveries = 3
        with pytest.raises(JobFailed) as parked:
            Client(redis_url, namespace=namespace).job("unlucky").result(timeout=30)
        assert parked.value.code == "max_deliveries"
        [letter] = list_dead(raw, keys)
        assert letter.job_id == "unlucky" and letter.stream == keys.batch
        assert "delivered 4 times" in letter.reason
        assert len(requeue(raw, keys)[0]) == 1 and list_dead(raw, keys) == []
        assert wait_for_status(raw, keys.job("unlucky"), b"done") == b"done"
        assert Client(redis_url, namespace=namespace).job("unlucky").result(timeout=5).token_ids
    assert raw.hget(keys.job("unlucky"), "attempt") == b"1"


def test_dead_cli_lists_and_requeues(redis_url, namespace, capsys):
    from conveyor.cli import main

    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    raw.xadd(
        keys.dead,
        {
            "stream": keys.interactive,
            "entry_id": "1-0",
            "reason": "invalid_job: prompt: missing",
            "at": "1700000000",
            "job_id": "j-dead",
            "field:json": '{"job_id": "j-dead"}',
        },
    )
    assert main(["dead", "list", "--redis-url", redis_url, "--namespace", namespace]) == 0
    listed = capsys.readouterr().out
    assert "job=j-dead" in listed and "invalid_job: prompt: missing" in listed
    assert main(["dead", "requeue", "--redis-url", redis_url, "--namespace", namespace]) == 0
    assert "requeued 1 job(s)" in capsys.readouterr().out
    assert raw.xlen(keys.dead) == 0 and raw.xrange(keys.interactive)[0][1] == {b"json": b'{"job_id": "j-dead"}'}


def test_hostile_dead_letters_fail_alone_and_touch_nothing_else(redis_url, namespace, capsys):
    """The dead stream is input: a letter naming a key outside this namespace's request
    streams, a stream key that is not a stream, or more fields than a script can take
    fails with its reason; the good letter among them is requeued, nothing else is written."""
    from conveyor.cli import main

    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    raw.set(keys.job("victim"), "a string")
    raw.set(f"{keys.batch}:not-a-stream", "x")
    letters = {
        "foreign": {"stream": keys.job("victim"), "field:data": b"x"},
        "other-namespace": {"stream": "elsewhere:requests:batch", "field:data": b"x"},
        "wrong-type": {"stream": f"{keys.batch}:not-a-stream", "field:data": b"x"},
        "too-many-fields": {"stream": keys.batch, **{f"field:f{i}": b"v" for i in range(3001)}},
        "good": {"stream": keys.batch, "field:data": b"payload"},
    }
    ids = {name: raw.xadd(keys.dead, fields) for name, fields in letters.items()}
    new_ids, skipped, failed = requeue(raw, keys)
    assert len(new_ids) == 1 and not skipped
    reasons = {letter.dead_id: why for letter, why in failed}
    assert set(reasons) == {ids[name].decode() for name in letters if name != "good"}
    assert "is not a request stream" in reasons[ids["foreign"].decode()]
    assert "is not a request stream" in reasons[ids["other-namespace"].decode()]
    assert "WRONGTYPE" in reasons[ids["wrong-type"].decode()]
    assert "too many to requeue" in reasons[ids["too-many-fields"].decode()]
    assert raw.get(keys.job("victim")) == b"a string" and not raw.exists("elsewhere:requests:batch")
    assert raw.xrange(keys.batch) == [(new_ids[0].encode(), {b"data": b"payload"})]
    assert raw.xlen(keys.dead) == 4  # the failed letters stay for the operator
    assert main(["dead", "requeue", "--redis-url", redis_url, "--namespace", namespace]) == 1
    assert capsys.readouterr().out.count("could not requeue") == 4


def test_a_letter_on_another_partitions_stream_is_not_requeued(redis_url, namespace):
    """Partitioned layout: a job's entry belongs to its own partition's stream (its record
    lives in that slot); a letter naming another partition's stream fails alone, the one
    on the right stream is requeued."""
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace, partitions=4)
    job_id = "job-on-its-partition"
    own = keys.partition_of(job_id)
    wrong_stream, right_stream = keys.requests("batch", (own + 1) % 4), keys.requests("batch", own)
    wrong = raw.xadd(keys.dead, {"stream": wrong_stream, "job_id": job_id, "field:data": b"x"}).decode()
    raw.xadd(keys.dead, {"stream": right_stream, "job_id": job_id, "field:data": b"y"})
    new_ids, skipped, failed = requeue(raw, keys)
    assert len(new_ids) == 1 and not skipped
    assert [(letter.dead_id, why) for letter, why in failed] == [
        (wrong, f"stream: {wrong_stream!r} is not the partition of job {job_id!r}")
    ]
    assert raw.xlen(right_stream) == 1 and not raw.exists(wrong_stream)
