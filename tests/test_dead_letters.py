"""Dead letters: parked with the reason and the original fields, listed, and requeued."""
import json
import time

import pytest
import redis

from clients import Client, JobFailed
from clients.dead_letters import list_dead, requeue
from clients.keys import Keys
from model_factory import build_tiny_model
from replica_harness import ReplicaThread


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
    raw.xadd(keys.batch, {"json": json.dumps({"job_id": "unlucky", "prompt": "def f():", "max_tokens": 4,
                                              "temperature": 0, "priority_class": "batch"})})
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
    from actors.cli import main
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    raw.xadd(keys.dead, {"stream": keys.interactive, "entry_id": "1-0", "reason": "invalid_job: prompt: missing",
                         "at": "1700000000", "job_id": "j-dead", "field:json": '{"job_id": "j-dead"}'})
    assert main(["dead", "list", "--redis-url", redis_url, "--namespace", namespace]) == 0
    listed = capsys.readouterr().out
    assert "job=j-dead" in listed and "invalid_job: prompt: missing" in listed
    assert main(["dead", "requeue", "--redis-url", redis_url, "--namespace", namespace]) == 0
    assert "requeued 1 job(s)" in capsys.readouterr().out
    assert raw.xlen(keys.dead) == 0 and raw.xrange(keys.interactive)[0][1] == {b"json": b'{"job_id": "j-dead"}'}
