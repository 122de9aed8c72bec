"""Model info for light clients: publish/fetch on a real Valkey, TokenCounter against
transformers on SmolLM2's tokenizer, routing of jobs that name a model, and status."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest
import redis

from conveyor import cli as conveyor_cli
from conveyor.clients import AsyncClient, Client, ProtocolError
from conveyor.clients.keys import Keys
from conveyor.clients.model_info import (
    ModelInfo,
    ModelNotPublished,
    fetch_model_info,
    fetch_model_info_async,
    publish_model_info,
    publish_model_info_async,
    wait_for_model_info,
    wait_for_model_info_async,
)
from conveyor.clients.token_counter import TokenCounter

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Summarize: queues are nice."}],
    [
        {"role": "user", "content": "Two turns"},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Ünïcode ✓ and   spaces\n\n\tand tabs"},
    ],
    [{"role": "user", "content": "special tokens in text: <|im_start|>user <|im_end|> <|endoftext|>"}],
    [{"role": "user", "content": "x" * 3000}],
    [{"role": "user", "content": "with a None field", "name": None}],
]

# Uses what transformers' sandbox adds: namespace, loop controls, tojson, raise_exception, generation.
RICH_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad') }}"
    "{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ bos_token }}[{{ m.role }}|{{ m | tojson }}]{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% endif %}\n{% endfor %}{{ ns.n }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from conveyor.engine.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))


@pytest.fixture(scope="module")
def info(hf_tokenizer):
    return ModelInfo.from_hf_tokenizer("smollm2", 8192, {2}, hf_tokenizer)


@pytest.fixture(scope="module")
def counter(info):
    return info.token_counter()


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(counter, hf_tokenizer, conversation, add_generation_prompt):
    text = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert counter.render_chat(conversation, add_generation_prompt) == text
    expected = hf_tokenizer.encode(text, add_special_tokens=False)  # what the engine feeds the model
    assert counter.encode_chat(conversation, add_generation_prompt) == expected
    assert counter.count_chat(conversation, add_generation_prompt) == len(expected)


def test_sandbox_features_render_like_transformers(hf_tokenizer, info):
    counter = TokenCounter.from_json(info.tokenizer_json, RICH_TEMPLATE, info.special_tokens)
    conversation = [{"role": "user", "content": 'a "quoted" <b>'}, {"role": "assistant", "content": "ok"}] * 4
    expected = hf_tokenizer.apply_chat_template(
        conversation, chat_template=RICH_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert counter.render_chat(conversation) == expected
    with pytest.raises(Exception, match="bad"):
        counter.render_chat([{"role": "bad", "content": ""}])


@pytest.mark.parametrize("text", ["Hello world", "  leading spaces\n\nand paragraphs.", "数字 123 😀", "a" * 5000])
def test_plain_counts_match_transformers(counter, hf_tokenizer, text):
    assert counter.encode(text) == hf_tokenizer.encode(text)
    assert counter.count(text, add_special_tokens=False) == len(hf_tokenizer.encode(text, add_special_tokens=False))


def test_publish_and_fetch_round_trip(redis_client, namespace, info):
    client = Client(redis_client=redis_client, namespace=namespace)
    publish_model_info(redis_client, client.keys, info, ttl_s=120)
    fetched = fetch_model_info(redis_client, client.keys)  # the only published model
    assert (fetched.name, fetched.max_model_len, fetched.eos_token_ids) == ("smollm2", 8192, (2,))
    assert fetched.chat_template == info.chat_template and fetched.tokenizer_json == info.tokenizer_json
    assert fetched.bos_token == "<|im_start|>" and fetched.published_at
    assert 0 < redis_client.ttl(client.keys.model_info("smollm2")) <= 120
    assert redis_client.smembers(client.keys.models) == {b"smollm2"}
    assert fetched.token_counter().count("Hello world") == info.token_counter().count("Hello world")


def test_fetch_errors_name_the_problem(redis_client, namespace, info):
    keys = Client(redis_client=redis_client, namespace=namespace).keys
    with pytest.raises(ModelNotPublished, match="no model info published"):
        fetch_model_info(redis_client, keys)
    with pytest.raises(ModelNotPublished, match="'other'"):
        fetch_model_info(redis_client, keys, "other")
    publish_model_info(redis_client, keys, info)
    publish_model_info(redis_client, keys, ModelInfo("tiny", 256, (0,)))
    with pytest.raises(ModelNotPublished, match="several models"):
        fetch_model_info(redis_client, keys)
    redis_client.hset(keys.model_info("smollm2"), "tokenizer_sha256", "0" * 64)
    with pytest.raises(ProtocolError, match="tokenizer_sha256"):
        fetch_model_info(redis_client, keys, "smollm2")
    redis_client.delete(keys.model_info("smollm2"))  # expired: the set member is ignored
    assert fetch_model_info(redis_client, keys).name == "tiny"


def test_async_publish_and_fetch(redis_url, namespace, info):
    async def main():
        async with AsyncClient(redis_url, namespace) as client:
            await publish_model_info_async(client.redis, client.keys, info)
            return await fetch_model_info_async(client.redis, client.keys, "smollm2")

    assert asyncio.run(main()).tokenizer_json == info.tokenizer_json


def test_jobs_naming_a_model_go_to_its_streams(redis_client, namespace):
    client = Client(redis_client=redis_client, namespace=namespace)
    first = client.submit("hi", model="smollm2", priority_class="batch")
    again = client.submit("hi", model="smollm2", priority_class="batch", job_id=first.job_id)
    client.submit("plain")
    assert (first.enqueued, again.enqueued) == (True, False)
    assert redis_client.xlen(client.keys.model_requests("smollm2", "batch")) == 1
    assert redis_client.xlen(client.keys.batch) == 0 and redis_client.xlen(client.keys.interactive) == 1
    assert client.keys.all_model_requests("smollm2") == (
        f"{namespace}:requests:interactive:smollm2",
        f"{namespace}:requests:batch:smollm2",
    )


def test_status_shows_models_and_jobs_nobody_serves(redis_url, redis_client, namespace, info, capsys):
    client = Client(redis_client=redis_client, namespace=namespace)
    publish_model_info(redis_client, client.keys, info)
    served = client.keys.model_requests("smollm2", "interactive")
    redis_client.xgroup_create(served, "engines", id="0", mkstream=True)
    client.submit("a", model="smollm2")
    redis_client.xreadgroup("engines", "replica-1", {served: ">"}, count=1)
    client.submit("b", model="ghost", priority_class="batch")
    status = client.queue_status()
    smol, ghost = status["models"]["smollm2"], status["models"]["ghost"]
    assert (smol["published"], smol["max_model_len"], smol["queued"], smol["unserved"]) == (True, 8192, 1, False)
    assert smol["requests"]["interactive"]["consumers"][0]["name"] == "replica-1"
    assert (ghost["published"], ghost["queued"], ghost["unserved"]) == (False, 1, True)
    assert status["requests"]["batch"]["length"] == 0
    assert conveyor_cli.main(["status", "--redis-url", redis_url, "--namespace", namespace]) == 0
    out = capsys.readouterr().out
    assert "model smollm2 (published, max_model_len 8192)" in out
    assert "! 1 queued jobs for model 'ghost' and no replica serves it (no replica published it)" in out


def test_async_status_matches_sync(redis_url, redis_client, namespace):
    Client(redis_client=redis_client, namespace=namespace).submit("b", model="ghost")

    async def main():
        async with AsyncClient(redis_url, namespace) as client:
            return await client.queue_status()

    assert asyncio.run(main())["models"]["ghost"]["unserved"] is True


# ---------------------------------------------------------------- waiting for a replica


@contextmanager
def published_later(redis_url: str, keys: Keys, info: ModelInfo, after_s: float = 1.0):
    """Publish `info` from a thread after `after_s`, as a replica does once its model is loaded."""

    def publish():
        time.sleep(after_s)
        conn = redis.Redis.from_url(redis_url)
        publish_model_info(conn, keys, info, ttl_s=120)
        conn.close()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(10)


TINY = ModelInfo("tiny", 256, (0,))


@pytest.mark.parametrize("model", ["tiny", None])
def test_wait_returns_the_model_info_once_a_replica_publishes_it(redis_url, redis_client, namespace, capsys, model):
    keys = Keys(namespace)
    started = time.monotonic()
    with published_later(redis_url, keys, TINY):
        info = wait_for_model_info(redis_client, keys, model, wait_s=30)
    waited = time.monotonic() - started
    assert (info.name, info.max_model_len, info.eos_token_ids) == ("tiny", 256, (0,))
    assert 0.9 <= waited < 10
    err = capsys.readouterr().err
    expected = "a replica serving model 'tiny'" if model else "a replica to publish its model"
    assert f"waiting for {expected} in namespace {namespace!r} (0 s of 30 s)" in err
    assert wait_for_model_info(redis_client, keys, model, wait_s=30).name == "tiny"  # published: no wait
    assert capsys.readouterr().err == ""


def test_async_wait_returns_the_model_info_once_a_replica_publishes_it(redis_url, namespace, capsys):
    async def main():
        async with AsyncClient(redis_url, namespace) as client:
            with published_later(redis_url, client.keys, TINY):
                return await wait_for_model_info_async(client.redis, client.keys, "tiny", 30)

    assert asyncio.run(main()).name == "tiny"
    assert "waiting for a replica serving model 'tiny'" in capsys.readouterr().err


def test_wait_gives_up_after_its_limit_and_says_so(redis_url, redis_client, namespace, capsys):
    keys = Keys(namespace)
    started = time.monotonic()
    with pytest.raises(ModelNotPublished, match=r"within the wait limit of 1\.2 s \(wait_s, --wait-s\)") as caught:
        wait_for_model_info(redis_client, keys, "tiny", wait_s=1.2, progress=False)
    assert 1.2 <= time.monotonic() - started < 5
    assert (
        "no replica published model 'tiny'" in caught.value.message and "no replica serves it" in caught.value.message
    )
    assert capsys.readouterr().err == "", "progress=False prints nothing"

    async def main():
        async with AsyncClient(redis_url, namespace) as client:
            await wait_for_model_info_async(client.redis, client.keys, None, 0.6)

    with pytest.raises(ModelNotPublished, match=r"any model info in namespace .* within the wait limit of 0\.6 s"):
        asyncio.run(main())
    assert "(0 s of 0.6 s)" in capsys.readouterr().err


def test_wait_zero_looks_once_and_ambiguity_is_not_waited_on(redis_client, namespace):
    keys = Keys(namespace)
    started = time.monotonic()
    with pytest.raises(ModelNotPublished, match="no model info published") as caught:
        wait_for_model_info(redis_client, keys, None, wait_s=0)
    assert "wait limit" not in caught.value.message  # the fetch's own error, at once
    with pytest.raises(ValueError, match="wait_s"):
        wait_for_model_info(redis_client, keys, None, wait_s=-1)
    publish_model_info(redis_client, keys, TINY)
    publish_model_info(redis_client, keys, ModelInfo("other", 128, (0,)))
    with pytest.raises(ModelNotPublished, match="several models"):
        wait_for_model_info(redis_client, keys, None, wait_s=30)  # waiting would not help
    assert time.monotonic() - started < 5
