"""`conveyor submit "text"` makes the same job whenever it runs (issue 39 item 11).

It used to ask Redis whether the model had a chat template: right after `conveyor serve`
started the answer was "no model info yet" and the job was a raw prompt, a minute later a
chat message, so the same --job-id then failed as "already submitted with a different
payload". The job now says chat_template="auto" and the replica, which knows its model,
applies the template where there is one."""

import pytest
from replica_harness import ReplicaThread

from conveyor import cli as conveyor_cli
from conveyor.clients import Client
from conveyor.clients.errors import InvalidJob
from conveyor.clients.protocol import JobRequest, decode_job, payload_digest, validate_job


def test_the_same_command_submits_the_same_job_before_and_after_a_model_is_published(redis_url, namespace):
    flags = ["--redis-url", redis_url, "--namespace", namespace, "--job-id", "same-job", "--no-wait", "--quiet"]
    assert conveyor_cli.main(["submit", "Hello there", *flags]) == 0  # no replica, no model info yet
    client = Client(redis_url, namespace=namespace)
    try:
        client.redis.hset(client.keys.model_info("m"), mapping={"chat_template": "{{ messages }}"})
        client.redis.sadd(client.keys.models, "m")
        assert conveyor_cli.main(["submit", "Hello there", *flags]) == 0, "the same payload: no conflict"
        [(_, fields)] = client.redis.xrange(client.keys.requests("interactive"))
        digest = client.redis.hget(client.keys.job("same-job"), "digest").decode()
    finally:
        client.close()
    job = decode_job(fields)
    assert job.prompt == "Hello there" and job.chat_template == "auto"
    assert digest == payload_digest(job)


def test_chat_template_auto_is_part_of_the_digest_and_needs_a_prompt():
    raw = JobRequest(prompt="Hi")
    auto = JobRequest(prompt="Hi", chat_template="auto")
    assert payload_digest(raw) != payload_digest(auto)
    assert payload_digest(raw) == payload_digest(JobRequest(prompt="Hi", chat_template=None)), "older digests hold"
    with pytest.raises(InvalidJob, match="chat_template"):
        validate_job({"messages": [{"role": "user", "content": "Hi"}], "chat_template": "auto"})
    for hostile in ("always", "x" * 100_000, 1, ["auto"], {"auto": True}):  # only "auto" or null
        with pytest.raises(InvalidJob, match="chat_template"):
            validate_job({"prompt": "Hi", "chat_template": hostile})


def test_the_replica_applies_the_models_template_to_an_auto_prompt(tiny_model, redis_url, namespace):
    with ReplicaThread(tiny_model, redis_url, namespace, max_num_seqs=4) as running:
        tokenizer = running.engine.tokenizer
        assert tokenizer.chat_template, "the tiny model has a chat template"
        chat = [{"role": "user", "content": "Hi"}]
        chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        client = Client(redis_url, namespace=namespace)
        try:
            params = dict(max_tokens=2, temperature=0)
            auto = client.submit("Hi", chat_template="auto", **params).result(timeout=60)
            raw = client.submit("Hi", **params).result(timeout=60)
        finally:
            client.close()
    assert auto.usage.prompt_tokens == len(chat_ids) > raw.usage.prompt_tokens
