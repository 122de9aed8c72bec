"""Jobs with n > 1 through a real replica (tiny model, real Valkey): fan-out into samples
sharing one prefill, fan-in into one out stream and one terminal event."""

import asyncio
import json
import uuid

import msgpack
import pytest
import redis
from model_factory import mixed_prompts
from replica_harness import ReplicaThread

from conveyor.clients import AsyncClient, Client, InvalidJob, JobCancelled, JobFailed
from conveyor.clients.keys import Keys
from conveyor.engine import LLM, SamplingParams

ENGINE_OPTIONS = dict(max_num_seqs=16, max_num_batched_tokens=256)
SAMPLED = dict(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=12)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, **ENGINE_OPTIONS)


@pytest.fixture(params=[False, True], ids=["sync_steps", "overlapped_steps"])
def replica(request, tiny_model, redis_url, namespace):
    with ReplicaThread(tiny_model, redis_url, namespace, async_scheduling=request.param, **ENGINE_OPTIONS) as running:
        yield running


def out_events(redis_url, namespace, job_id):
    raw = redis.Redis.from_url(redis_url)
    return [msgpack.unpackb(fields[b"data"]) for _, fields in raw.xrange(Keys(namespace).out(job_id))]


def test_n_outputs_match_offline_and_stream_by_index(replica, redis_url, namespace, offline):
    prompt = mixed_prompts(768, n=1, seed=4, min_len=50, max_len=50)[0]
    client = Client(redis_url, namespace=namespace)
    job = client.submit(prompt_token_ids=prompt, **SAMPLED)
    streamed = {}
    seqs = []
    for event in job.stream(timeout=60):
        streamed.setdefault(event.index, []).extend(event.token_ids)
        seqs.append(event.seq)
    result = job.result(timeout=60)
    expected = offline.generate([prompt], SamplingParams(**SAMPLED), use_tqdm=False)[0]
    assert [o.token_ids for o in result.outputs] == [c.token_ids for c in expected.outputs]
    assert [o.text for o in result.outputs] == [c.text for c in expected.outputs]
    assert [o.index for o in result.outputs] == [0, 1, 2] and len({tuple(o.token_ids) for o in result.outputs}) == 3
    assert {i: ids for i, ids in streamed.items()} == {o.index: o.token_ids for o in result.outputs}
    assert seqs == list(range(len(seqs)))  # one numbering for the job's events, no gaps
    assert (result.text, result.token_ids) == (result.outputs[0].text, result.outputs[0].token_ids)
    assert result.usage.completion_tokens == sum(len(o.token_ids) for o in result.outputs) == 36
    types = [event["type"] for event in out_events(redis_url, namespace, job.job_id)]
    assert types.count("done") == 1 and types[-1] == "done"

    async def read_async():
        async with AsyncClient(redis_url, namespace=namespace) as client:
            return await client.job(job.job_id).result(timeout=30)

    assert asyncio.run(read_async()).outputs == result.outputs


def test_an_n_1_job_keeps_the_old_event_shape(replica, redis_url, namespace):
    client = Client(redis_url, namespace=namespace)
    result = client.submit(prompt="def main():", max_tokens=4, temperature=0).result(timeout=30)
    events = out_events(redis_url, namespace, result.job_id)
    assert all("index" not in event for event in events) and "outputs" not in events[-1]
    assert [o.token_ids for o in result.outputs] == [result.token_ids]  # the client fills outputs in


def test_n_over_the_limit_is_refused_naming_the_field(replica, redis_url, namespace):
    client = Client(redis_url, namespace=namespace)
    with pytest.raises(InvalidJob, match=r"n: Input should be less than or equal to 16"):
        client.submit(prompt="hi", n=17)
    job_id = f"many-{uuid.uuid4().hex[:6]}"
    redis.Redis.from_url(redis_url).xadd(
        Keys(namespace).interactive, {"json": json.dumps({"job_id": job_id, "prompt": "hi", "n": 99})}
    )
    with pytest.raises(JobFailed) as failure:
        client.job(job_id).result(timeout=30)
    assert failure.value.code == "invalid_job"
    assert "n: Input should be less than or equal to 16 (got 99)" in failure.value.message


def test_cancelling_an_n_job_ends_every_sample_once(replica, redis_url, namespace):
    client = Client(redis_url, namespace=namespace)
    job = client.submit(prompt="def main():", n=4, temperature=1.0, seed=5, max_tokens=400, ignore_eos=True)
    with pytest.raises(JobCancelled):
        for event in job.stream(timeout=60):
            if event.seq == 3:
                assert job.cancel() is True
    types = [event["type"] for event in out_events(redis_url, namespace, job.job_id)]
    assert types.count("cancelled") == 1 and types[-1] == "cancelled"
    assert client.submit(prompt="ok", max_tokens=2, temperature=0).result(timeout=30).token_ids
    engine = replica.engine
    assert not engine.scheduler.seqs and not engine.samples.parents and not engine.samples.parent_of
