"""A real replica (tiny model, real Valkey) driven through the Redis front door."""

import asyncio
import json
import time

import msgpack
import pytest
import redis
from model_factory import mixed_prompts
from replica_harness import ReplicaThread, run_producers

from conveyor.clients import Client
from conveyor.clients.errors import JobFailed
from conveyor.clients.keys import Keys
from conveyor.engine import LLM, SamplingParams

ENGINE_OPTIONS = dict(max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, **ENGINE_OPTIONS)


@pytest.fixture(params=[False, True], ids=["sync_steps", "overlapped_steps"])
def replica(request, tiny_model, redis_url, namespace):
    with ReplicaThread(tiny_model, redis_url, namespace, async_scheduling=request.param, **ENGINE_OPTIONS) as running:
        assert running.engine.overlaps_steps is request.param  # the core steps it, overlapped or not
        yield running


def job_specs(count, seed):
    prompts = mixed_prompts(768, n=count, seed=seed, min_len=1, max_len=120)
    specs = []
    for index, prompt in enumerate(prompts):
        spec = {"prompt_token_ids": prompt, "max_tokens": 4 + index % 20, "temperature": 0.0}
        if index % 3 == 1:
            spec.update(temperature=0.8, top_p=0.9, seed=1000 + index)
        if index % 4 == 2:
            spec.update(priority_class="batch", ignore_eos=True)
        specs.append(spec)
    return specs


def offline_expectation(llm, spec):
    params = SamplingParams(**{k: v for k, v in spec.items() if k not in ("prompt_token_ids", "priority_class")})
    return llm.generate([spec["prompt_token_ids"]], params, use_tqdm=False)[0]


def test_fifty_jobs_from_three_producers_match_offline(replica, redis_url, namespace, offline):
    results = {}

    def producer(index):
        client = Client(redis_url, namespace=namespace)
        specs = job_specs(17 if index < 2 else 16, seed=index)
        jobs = [(client.submit(**spec), spec) for spec in specs]
        for job, spec in jobs:
            deltas, seqs = [], []
            for event in job.stream(timeout=60):
                deltas.append(event.text)
                seqs.append(event.seq)
            results[job.job_id] = (spec, job.result(timeout=60), "".join(deltas), seqs)

    run_producers(producer, 3, timeout=180)
    assert len(results) == 50
    for spec, result, streamed, seqs in results.values():
        expected = offline_expectation(offline, spec)
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text == streamed
        assert seqs == list(range(len(seqs)))
        assert result.finish_reason == expected.finish_reason
        assert result.usage.completion_tokens == len(result.token_ids)


def test_raw_xadd_with_json_field_completes(replica, redis_url, namespace):
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    raw.xadd(
        keys.interactive,
        {"json": json.dumps({"job_id": "raw-1", "prompt": "def main():", "max_tokens": 5, "temperature": 0})},
    )
    result = Client(redis_url, namespace=namespace).job("raw-1").result(timeout=30)
    assert result.finish_reason in ("stop", "length") and result.token_ids
    assert raw.hget(keys.job("raw-1"), "status") == b"done"
    assert raw.ttl(keys.job("raw-1")) > 0 and raw.ttl(keys.out("raw-1")) > 0
    assert raw.xlen(keys.interactive) == 0  # acked and deleted


@pytest.mark.parametrize(
    "fields, expect_event",
    [
        ({"data": b"\xc1\xff not msgpack"}, False),
        ({"data": msgpack.packb({"job_id": "bad-type", "prompt": "hi", "max_tokens": "5"})}, True),
        ({"data": msgpack.packb({"job_id": "no-prompt", "max_tokens": 5})}, True),
        ({"json": json.dumps({"job_id": "bad-temp", "prompt": "hi", "temperature": -1})}, True),
        ({"json": "{not json"}, False),
    ],
)
def test_malformed_entries_are_reported_and_the_replica_keeps_serving(
    replica, redis_url, namespace, fields, expect_event
):
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    raw.xadd(keys.interactive, fields)
    client = Client(redis_url, namespace=namespace)
    good = client.submit(prompt="hello", max_tokens=3, temperature=0)
    assert good.result(timeout=30).token_ids  # the next job is served
    dead = raw.xrange(keys.dead)
    assert len(dead) == 1 and dead[0][1][b"reason"]
    if expect_event:
        job_id = json.loads(fields["json"])["job_id"] if "json" in fields else msgpack.unpackb(fields["data"])["job_id"]
        with pytest.raises(JobFailed) as failure:
            client.job(job_id).result(timeout=10)
        assert failure.value.code and failure.value.message
    assert raw.xlen(keys.interactive) == 0


def test_unknown_fields_are_ignored(replica, redis_url, namespace):
    raw = redis.Redis.from_url(redis_url)
    raw.xadd(
        Keys(namespace).interactive,
        {
            "data": msgpack.packb(
                {"job_id": "extra", "prompt": "hi", "max_tokens": 2, "temperature": 0, "colour": "blue"}
            )
        },
    )
    assert Client(redis_url, namespace=namespace).job("extra").result(timeout=30).token_ids


def test_engine_level_errors_reach_the_job(replica, redis_url, namespace):
    client = Client(redis_url, namespace=namespace)
    job = client.submit(prompt_token_ids=[5] * 1000, max_tokens=100)  # beyond max_model_len 1024
    with pytest.raises(JobFailed) as failure:
        job.result(timeout=30)
    assert "max_model_len" in failure.value.message
    assert client.submit(prompt="ok", max_tokens=2).result(timeout=30).token_ids


def test_two_replicas_split_the_work_and_each_job_ends_once(tiny_model, redis_url, namespace):
    with (
        ReplicaThread(tiny_model, redis_url, namespace, consumer="a", **ENGINE_OPTIONS) as first,
        ReplicaThread(tiny_model, redis_url, namespace, consumer="b", **ENGINE_OPTIONS) as second,
    ):
        client = Client(redis_url, namespace=namespace)
        jobs = client.submit_many(
            [
                {"prompt_token_ids": p, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
                for p in mixed_prompts(768, n=40, seed=7, min_len=20, max_len=100)
            ],
            progress=False,
        )
        for job in jobs:
            job.result(timeout=120)
        assert first.replica.engine_core.steps > 0 and second.replica.engine_core.steps > 0
    raw = redis.Redis.from_url(redis_url)
    for job in jobs:
        types = [fields[b"type"] for _, fields in raw.xrange(Keys(namespace).out(job.job_id))]
        assert sum(t in (b"done", b"error", b"cancelled") for t in types) == 1
        assert types[-1] == b"done"


@pytest.mark.slow
def test_event_loop_stays_responsive_during_a_long_prefill(redis_url, namespace):
    """SmolLM2 prefills 2,000 tokens in one multi-second step on the engine core's thread;
    meanwhile a periodic task on the replica's loop must keep running between the step's
    chunks of work. Judged against the same loop idle, on the same box, just before (no
    wall-clock constant: a loaded box slows both): a loop that waited on the step would
    stall for about the whole prefill and tick a handful of times; one that keeps serving
    other coroutines ticks all along, its longest stall a small part of the step."""
    with ReplicaThread("smollm2", redis_url, namespace, max_num_seqs=4, max_num_batched_tokens=2048) as running:
        client = Client(redis_url, namespace=namespace)

        async def ticks(until):
            """Lags of a 10 ms periodic task on the replica's loop, until `until()`."""
            loop = asyncio.get_running_loop()
            lags = []
            while not until():
                before = loop.time()
                await asyncio.sleep(0.01)
                lags.append(loop.time() - before - 0.01)
            return lags

        idle_ends = time.monotonic() + 1.0
        idle = running.call(ticks(lambda: time.monotonic() >= idle_ends), timeout=60)  # the baseline
        job = client.submit(prompt_token_ids=[100 + i % 5000 for i in range(2000)], max_tokens=2)
        started = time.perf_counter()
        lags = running.call(ticks(lambda: running.replica.engine_core.steps), timeout=120)  # until the prefill is done
        prefill_s = time.perf_counter() - started
        job.result(timeout=60)
    assert prefill_s > 1.0, "the prefill must be long for this check to mean anything"
    idle_rate = len(idle) / 1.0  # ticks per second of the idle loop
    report = (
        f"during a {prefill_s:.1f} s prefill: {len(lags)} ticks, longest stall {max(lags):.3f} s; "
        f"idle: {idle_rate:.0f} ticks/s, longest stall {max(idle):.3f} s"
    )
    # kept serving: at least a tenth of the idle loop's ticks (a blocked loop ticks about once)
    assert len(lags) >= max(20, idle_rate * prefill_s / 10), report
    # never waited on the step: its longest stall is a quarter of the step at most (a loop that
    # waited would stall for about all of it), or within 10x the idle loop's own worst
    assert max(lags) < max(prefill_s / 4, 10 * max(idle)), report


def test_prometheus_endpoint_is_scraped_during_a_run(tiny_model, redis_url, namespace):
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    running = ReplicaThread(tiny_model, redis_url, namespace, **ENGINE_OPTIONS)
    running.config.metrics_port = port
    with running:
        client = Client(redis_url, namespace=namespace)
        jobs = [
            client.submit(prompt_token_ids=p, max_tokens=8, ignore_eos=True, temperature=0)
            for p in mixed_prompts(768, n=6, seed=5, min_len=5, max_len=40)
        ]
        for job in jobs:
            job.result(timeout=60)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines() if line and not line.startswith("#")
    }
    assert values["conveyor_generation_tokens_total"] == 48
    assert values["conveyor_requests_finished_total"] == 6
    assert values["conveyor_time_to_first_token_seconds_count"] == 6
    assert values["conveyor_inter_token_latency_seconds_count"] > 0
    for name in (
        "conveyor_num_requests_running",
        "conveyor_num_requests_waiting",
        "conveyor_kv_cache_usage_perc",
        "conveyor_kv_cache_fragmentation_perc",
        "conveyor_prefix_cache_hit_rate",
        "conveyor_num_preemptions",
        "conveyor_prompt_tokens_total",
        "conveyor_e2e_request_latency_seconds_count",
        "conveyor_request_queue_time_seconds_count",
    ):
        assert name in values


def test_second_submission_of_a_job_id_runs_once_and_conflicts_are_parked(replica, redis_url, namespace):
    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    job = {"job_id": "twice", "prompt": "def main():", "max_tokens": 6, "temperature": 0}
    raw.xadd(keys.interactive, {"json": json.dumps(job)})
    first = Client(redis_url, namespace=namespace).job("twice").result(timeout=30)
    raw.xadd(keys.interactive, {"json": json.dumps(job)})  # same payload: a duplicate
    raw.xadd(keys.interactive, {"json": json.dumps({**job, "prompt": "other"})})  # a conflict
    deadline = time.time() + 20
    while raw.xlen(keys.interactive) and time.time() < deadline:
        time.sleep(0.05)
    assert raw.xlen(keys.interactive) == 0
    terminal = [f for _, f in raw.xrange(keys.out("twice")) if f[b"type"] != b"token"]
    assert len(terminal) == 1  # ran once
    assert raw.hget(keys.job("twice"), "attempt") == b"1"
    assert Client(redis_url, namespace=namespace).job("twice").result(timeout=5).token_ids == first.token_ids
    dead = raw.xrange(keys.dead)
    assert len(dead) == 1 and b"conflict" in dead[0][1][b"reason"]


def test_replica_publishes_model_info_and_serves_its_model_streams(tiny_model, redis_url, namespace):
    from conveyor.clients.model_info import fetch_model_info
    from conveyor.clients.token_counter import TokenCounter

    raw = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    with ReplicaThread(tiny_model, redis_url, namespace, served_model_name="tiny", **ENGINE_OPTIONS) as running:
        client = Client(redis_url, namespace=namespace)
        named = client.submit(prompt="def main():", max_tokens=4, temperature=0, model="tiny")
        assert named.result(timeout=30).token_ids
        orphan = client.submit(prompt="hi", max_tokens=4, model="no-such-model")
        info = fetch_model_info(raw, keys, "tiny")
        assert info.max_model_len == 1024 and info.eos_token_ids
        assert raw.ttl(keys.model_info("tiny")) > 0
        counter = TokenCounter.from_json(info.tokenizer_json, info.chat_template)
        text = "def main():\n    return 42"
        assert counter.encode(text, add_special_tokens=False) == running.engine.tokenizer.encode(
            text, add_special_tokens=False
        )
        unserved = [line for line in _walk(client.queue_status()) if line.get("unserved")]
        assert unserved and "no-such-model" in json.dumps(unserved, default=str)
        assert orphan.status().status == "queued"


def _walk(value):
    """Every dict nested in a status report."""
    if isinstance(value, dict):
        yield value
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item)


def test_resubmitting_a_job_id_same_payload_shares_the_run_other_payload_conflicts(replica, redis_url, namespace):
    from conveyor.clients import JobConflict

    first_producer = Client(redis_url, namespace=namespace)
    second_producer = Client(redis_url, namespace=namespace)
    job = dict(job_id="shared", prompt="def main():", max_tokens=6, temperature=0)
    first = first_producer.submit(**job)
    second = second_producer.submit(**job)
    assert first.enqueued and not second.enqueued
    assert first.result(timeout=30).token_ids == second.result(timeout=30).token_ids
    with pytest.raises(JobConflict):
        second_producer.submit(**{**job, "prompt": "something else"})
    raw = redis.Redis.from_url(redis_url)
    assert raw.hget(Keys(namespace).job("shared"), "attempt") == b"1"
