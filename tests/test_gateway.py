"""The OpenAI-compatible gateway, end to end: a real `conveyor gateway` process, two real
`conveyor serve` replicas of a tiny model (lease 2 s) on the session's Valkey, and the
official `openai` SDK (sync and async) over loopback HTTP.

Greedy outputs through the gateway equal the offline engine's `LLM.generate`; errors come
back as the SDK's exceptions; a client that goes away cancels its job; and a stream
survives kill -9 of the replica running its job (the last test: it kills one replica)."""

from __future__ import annotations

import asyncio
import datetime
import json
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
import redis
from fault_harness import JobLedger, ServeProcess, check_attempt_sequences, wait_until
from gateway_harness import LIGHT_GATEWAY, REPO_ROOT, GatewayProcess, GatewayThread, async_openai_client, openai_client
from model_factory import build_tiny_model

from conveyor.clients import Client
from conveyor.clients.events import TokenEvent
from conveyor.clients.keys import GROUP, Keys
from conveyor.clients.usage import read_usage
from conveyor.gateway.streaming import BadLogprobs, Relay, StreamDiverged, checked_logprobs
from conveyor.gateway.tenants import KeyRing, load_grants, parse_key_list, read_keys_file

MODEL = "tiny"
MAIN_KEY, BATCH_KEY, EMPTY_KEY = "sk-main-0123", "sk-batch-4567", "sk-empty-89ab"
ADMIN_KEY = "sk-admin-cdef"
LEASE_S = 2.0
PROMPTS = ["def main():", "import os\n", "class Parser(object):\n    def"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    """Two replicas and one gateway process, started together; the offline engine loads meanwhile."""
    log_dir = tmp_path_factory.mktemp("gateway_logs")
    ns, empty_ns = f"gw-{uuid.uuid4().hex[:10]}", f"gw-empty-{uuid.uuid4().hex[:8]}"
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("gateway_llama"))
    keys_file = log_dir / "keys.json"
    keys_file.write_text(
        json.dumps(
            {
                MAIN_KEY: {"namespace": ns},
                BATCH_KEY: f"{ns}:batch",
                EMPTY_KEY: {"namespace": empty_ns, "priority_class": "interactive"},
                ADMIN_KEY: {"namespace": empty_ns, "admin": True},
            }
        )
    )
    replicas = [
        ServeProcess(
            model_dir, redis_url, ns, f"gw-replica-{n}", log_dir, lease_s=LEASE_S, args=["--served-model-name", MODEL]
        ).start()
        for n in "ab"
    ]
    gateway = GatewayProcess(redis_url, log_dir, keys_file=keys_file, args=["--replica-idle-s", "20"]).start()
    try:
        offline = _offline_engine(model_dir)
        for replica in replicas:
            replica.wait_ready()
        gateway.wait_ready()
        sdk = openai_client(gateway, MAIN_KEY)
        wait_until(lambda: [m.id for m in sdk.models.list().data] == [MODEL], 30, "the gateway to list the model")
        yield Stack(ns, empty_ns, redis_url, model_dir, replicas, gateway, offline)
    finally:
        gateway.stop()
        for replica in replicas:
            replica.stop()
        _delete_namespace(redis_url, ns)
    assert "Traceback" not in gateway.log_text(), gateway.log_text()[-3000:]


class Stack:
    def __init__(self, ns, empty_ns, redis_url, model_dir, replicas, gateway, offline):
        self.ns, self.empty_ns, self.redis_url, self.model_dir = ns, empty_ns, redis_url, model_dir
        self.replicas, self.gateway, self.offline = replicas, gateway, offline
        self.raw = redis.Redis.from_url(redis_url)
        self.keys = Keys(ns)

    def sdk(self, key: str = MAIN_KEY, **options) -> openai.OpenAI:
        return openai_client(self.gateway, key, **options)

    def expected(self, prompt, **sampling):
        """The offline engine's output for a prompt (text, or token ids)."""
        from conveyor.engine import SamplingParams

        params = SamplingParams(**{"temperature": 0.0, **sampling})
        return self.offline.generate([prompt], params, use_tqdm=False)[0]

    def chat_prompt_ids(self, messages) -> list[int]:
        tokenizer = self.offline.tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template holds the special tokens

    def status(self, job_id: str) -> str | None:
        value = self.raw.hget(self.keys.job(job_id), "status")
        return value.decode() if value else None

    def job_ids(self) -> set[str]:
        prefix = f"{self.ns}:job:"
        return {key.decode()[len(prefix) :] for key in self.raw.scan_iter(match=f"{prefix}*", count=1000)}


def _offline_engine(model_dir):
    import torch

    from conveyor.engine import LLM

    torch.set_num_threads(1)
    return LLM(model_dir)


def _delete_namespace(redis_url: str, ns: str) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{ns}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def long_request(**extra) -> dict:
    return {
        "model": MODEL,
        "prompt": "def main():",
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "extra_body": {"ignore_eos": True},
        **extra,
    }


# ---------------------------------------------------------------- pure pieces (no servers)


def token(attempt: int, seq: int, text: str, ids: list[int], reset: bool = False) -> TokenEvent:
    return TokenEvent(attempt=attempt, seq=seq, text=text, token_ids=ids, reset=reset)


def test_relay_passes_on_only_what_a_rerun_adds_beyond_what_was_sent():
    relay = Relay()
    assert relay.feed(token(1, 0, "Hel", [1, 2])) == ("Hel", [])
    assert relay.feed(token(1, 1, "lo", [3])) == ("lo", [])
    assert relay.feed(token(2, 0, "He", [1], reset=True)) == ("", [])  # catching up: nothing new
    assert relay.feed(token(2, 1, "llo, w", [2, 3, 4])) == (", w", [])
    assert relay.sent_text == "Hello, w"

    diverged = Relay()
    diverged.feed(token(1, 0, "Hello", [1, 2]))
    with pytest.raises(StreamDiverged):
        diverged.feed(token(2, 0, "Help", [1, 9], reset=True))


def test_relay_continues_a_resumed_attempt_from_what_it_carried_over():
    relay = Relay()
    relay.feed(token(1, 0, "Hel", [1, 2]))
    relay.feed(token(1, 1, "lo", [3]))
    resumed = TokenEvent(attempt=2, seq=0, text=", w", token_ids=[4], resumed_tokens=3, resumed_chars=5)
    assert relay.feed(resumed) == (", w", [])  # nothing sent again, nothing lost
    assert (relay.sent_text, relay.sent_ids) == ("Hello, w", [1, 2, 3, 4])
    cut = Relay()  # a resumed attempt that samples the last carried token again (it had ended the job)
    cut.feed(token(1, 0, "Hello", [1, 2, 3]))
    assert cut.feed(TokenEvent(attempt=2, seq=0, text="lo!", token_ids=[3, 5], resumed_tokens=2, resumed_chars=3)) == (
        "!",
        [],
    )


def test_api_keys_from_file_and_env_are_compared_by_digest(tmp_path):
    (tmp_path / "keys.yaml").write_text("k1: {namespace: team-a}\nk2: team-b:batch\n")
    grants = load_grants(str(tmp_path / "keys.yaml"), "k3=team-c, k2=team-b")
    assert {k: (g.namespace, g.priority_class) for k, g in grants.items()} == {
        "k1": ("team-a", "interactive"),
        "k2": ("team-b", "interactive"),
        "k3": ("team-c", "interactive"),
    }
    ring = KeyRing(grants)
    assert ring.grant_for("k3").namespace == "team-c" and ring.grant_for("k4") is None
    assert "secret-key" not in repr(vars(ring))  # only digests are kept
    with pytest.raises(ValueError) as bad:
        parse_key_list("secret-key=bad:namespace")
    assert "secret-key" not in str(bad.value)
    (tmp_path / "bad.json").write_text(json.dumps({"secret-key": {"namespace": "a b"}}))
    with pytest.raises(ValueError) as bad_file:
        read_keys_file(tmp_path / "bad.json")
    assert "secret-key" not in str(bad_file.value)


def test_logprobs_that_name_other_tokens_are_refused():
    good = TokenEvent(attempt=1, seq=0, text="a", token_ids=[7], logprobs=[{"token_id": 7, "logprob": -1.0, "top": []}])
    assert checked_logprobs(good) == good.logprobs
    with pytest.raises(BadLogprobs):
        checked_logprobs(
            TokenEvent(
                attempt=1, seq=1, text="b", token_ids=[8], logprobs=[{"token_id": 9, "logprob": -1.0, "top": []}]
            )
        )


# ---------------------------------------------------------------- models, health, auth


def test_junk_model_records_cost_only_themselves(stack):
    """Producers can write the models set and model-info hashes the gateway reads: non-UTF-8
    and overlong names, unreadable fields. The real model still lists and serves."""
    junk_names = [b"\xff\xfe", b"m" * 300, b"junk-model", b"bad-bytes"]
    stack.raw.sadd(stack.keys.models, *junk_names)
    stack.raw.hset(stack.keys.model_info("junk-model"), mapping={"max_model_len": "x" * 5000, "published_at": "nan"})
    stack.raw.hset(stack.keys.model_info("bad-bytes"), mapping={"max_model_len": "64", "tokenizer_sha256": b"\xff"})
    try:
        time.sleep(1.5)  # past the gateway's model cache
        sdk = stack.sdk()
        assert MODEL in [model.id for model in sdk.models.list().data]
        assert sdk.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        stack.raw.srem(stack.keys.models, *junk_names)
        stack.raw.delete(stack.keys.model_info("junk-model"), stack.keys.model_info("bad-bytes"))
        time.sleep(1.5)


def test_models_health_and_metrics(stack):
    sdk = stack.sdk()
    [model] = sdk.models.list().data
    assert model.id == MODEL and model.object == "model" and model.owned_by == "conveyor"
    assert model.model_extra["max_model_len"] == 1024
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")
    assert httpx.get(f"{stack.gateway.url}/health").json() == {"status": "ok"}
    sdk.completions.create(model=MODEL, prompt="x", max_tokens=1)
    metrics = httpx.get(f"{stack.gateway.url}/metrics").text
    assert 'conveyor_gateway_requests_total{route="/v1/completions",status="200"}' in metrics
    assert 'conveyor_gateway_request_duration_seconds_count{route="/v1/completions"}' in metrics
    assert "conveyor_gateway_requests_in_flight" in metrics


def test_missing_or_wrong_keys_are_401(stack):
    response = httpx.post(f"{stack.gateway.base_url}/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as wrong:
        stack.sdk("sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert wrong.value.code == "invalid_api_key" and "sk-wrong" not in str(wrong.value)
    assert "sk-wrong" not in stack.gateway.log_text()


def test_no_replica_in_the_namespace_is_503(stack):
    sdk = stack.sdk(EMPTY_KEY)
    assert sdk.models.list().data == []
    with pytest.raises(openai.InternalServerError) as failure:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert failure.value.status_code == 503 and failure.value.code == "no_replica"


# ---------------------------------------------------------------- outputs equal the offline engine's


def test_completions_greedy_equal_offline_streamed_or_not(stack):
    sdk = stack.sdk()
    for index, prompt in enumerate(PROMPTS):
        expected = stack.expected(prompt, max_tokens=12 + index)
        reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12 + index, temperature=0)
        assert reply.choices[0].text == expected.text
        assert reply.choices[0].finish_reason == expected.finish_reason
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
            len(expected.prompt_token_ids),
            len(expected.token_ids),
        )
        assert reply.id.startswith("cmpl-") and reply.object == "text_completion" and reply.model == MODEL
        chunks = list(
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12 + index, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    ids = stack.expected(PROMPTS[0], max_tokens=1).prompt_token_ids
    by_ids = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == stack.expected(ids, max_tokens=8).text


def test_chat_greedy_equals_offline_on_the_templated_prompt(stack):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
    ]
    flat = [messages[0], {"role": "user", "content": "def add(a, b):"}]
    expected = stack.expected(stack.chat_prompt_ids(flat), max_tokens=10)

    async def run():
        async with async_openai_client(stack.gateway, MAIN_KEY) as sdk:
            reply = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
            stream = await sdk.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_completion_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return reply, [chunk async for chunk in stream]

    reply, chunks = asyncio.run(run())
    assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.object == "chat.completion" and reply.service_tier == "default"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_concurrent_requests_each_get_their_own_output(stack):
    prompts = [f"def f{i}(x):" for i in range(16)]
    expected = {p: stack.expected(p, max_tokens=10).text for p in prompts}

    async def one(sdk, prompt, stream):
        if not stream:
            reply = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
            return reply.choices[0].text
        chunks = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    async def run():
        async with async_openai_client(stack.gateway, MAIN_KEY) as sdk:
            return await asyncio.gather(*(one(sdk, p, i % 2 == 0) for i, p in enumerate(prompts)))

    assert dict(zip(prompts, asyncio.run(run()))) == expected


def test_chat_without_max_tokens_gets_the_context_its_prompt_leaves(stack):
    body = "value = compute(1, 2)\n"
    content = body * 40
    while len(stack.chat_prompt_ids([{"role": "user", "content": content + body}])) < 1016:
        content += body
    messages = [{"role": "user", "content": content}]
    prompt_tokens = len(stack.chat_prompt_ids(messages))
    reply = stack.sdk().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 1024 - prompt_tokens and reply.choices[0].finish_reason == "length"


def test_sampling_fields_and_vllm_extras_reach_the_job(stack):
    sampling = dict(temperature=0.9, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=12)
    extras = dict(top_k=40, min_p=0.02, repetition_penalty=1.2, min_tokens=3)
    expected = stack.expected(PROMPTS[1], **sampling, **extras)
    reply = stack.sdk().completions.create(
        model=MODEL, prompt=PROMPTS[1], extra_body=extras, user="someone", **sampling
    )
    assert reply.choices[0].text == expected.text
    stop = expected.text[4:7]
    stopped = stack.sdk().completions.create(model=MODEL, prompt=PROMPTS[1], stop=[stop], extra_body=extras, **sampling)
    assert stopped.choices[0].text == stack.expected(PROMPTS[1], stop=[stop], **sampling, **extras).text
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs_of_chat_and_completions(stack):
    sdk = stack.sdk()
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "import"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
    chunks = list(
        sdk.completions.create(model=MODEL, prompt="def", max_tokens=6, temperature=0, logprobs=2, stream=True)
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    tokens = [t for lp in streamed for t in lp.tokens]
    offsets = [o for lp in streamed for o in lp.text_offset]
    assert len(tokens) == 6 and offsets == sorted(offsets) and offsets[0] == 0
    plain = sdk.completions.create(model=MODEL, prompt="def", max_tokens=6, temperature=0, logprobs=2)
    assert plain.choices[0].logprobs.tokens == tokens
    assert all(len(top) <= 2 for top in plain.choices[0].logprobs.top_logprobs)


def test_n_choices_of_completions_equal_offline_streamed_or_not(stack):
    sampling = dict(temperature=0.9, seed=77, max_tokens=8)
    expected = [c.text for c in stack.expected(PROMPTS[2], n=3, **sampling).outputs]
    assert len(set(expected)) == 3
    sdk = stack.sdk()
    reply = sdk.completions.create(model=MODEL, prompt=PROMPTS[2], n=3, logprobs=1, **sampling)
    assert [c.index for c in reply.choices] == [0, 1, 2] and [c.text for c in reply.choices] == expected
    assert [len(c.logprobs.tokens) for c in reply.choices] == [8, 8, 8] and reply.usage.completion_tokens == 24
    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPTS[2], n=3, stream=True, **sampling))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)}
    assert list(streamed.values()) == expected
    finishes = [c.choices[0] for c in chunks if c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1, 2] and {f.finish_reason for f in finishes} == {"length"}


def test_n_choices_of_chat_streamed_or_not(stack):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    sampling = dict(temperature=1.0, seed=5, max_tokens=6)
    expected = [c.text for c in stack.expected(stack.chat_prompt_ids(messages), n=2, **sampling).outputs]
    sdk = stack.sdk()
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, n=2, **sampling)
    assert [c.message.content for c in reply.choices] == expected and [c.index for c in reply.choices] == [0, 1]
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL, messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **sampling
        )
    )
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    by_index = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(2)
    }
    assert list(by_index.values()) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens == 12


def test_priority_class_from_the_key_service_tier_and_header(stack):
    def tier(key, **options):
        return (
            stack.sdk(key)
            .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=1, **options)
            .service_tier
        )

    assert tier(MAIN_KEY) == "default"
    assert tier(MAIN_KEY, service_tier="flex") == "flex"
    assert tier(MAIN_KEY, extra_headers={"X-Conveyor-Priority-Class": "batch"}) == "flex"
    assert tier(BATCH_KEY) == "flex"
    assert tier(BATCH_KEY, extra_headers={"X-Conveyor-Priority-Class": "interactive"}) == "flex"  # the key caps it


# ---------------------------------------------------------------- errors


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("completions", {"n": 17}, "n"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"suffix": "tail"}, "suffix"),
        ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("completions", {"prompt": ["one", "two"]}, "prompt"),
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("completions", {"extra_body": {"guided_json": {}}}, "guided_json"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"response_format": {"type": "grammar", "grammar": "root ::= x"}}, "response_format.type"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("chat", {"service_tier": "turbo"}, "service_tier"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ("chat", {"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_unsupported_or_invalid_fields_are_400_naming_the_field(stack, route, fields, param):
    sdk = stack.sdk()
    with pytest.raises(openai.BadRequestError) as failure:
        if route == "completions":
            sdk.completions.create(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
        else:
            sdk.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields})
    assert failure.value.param == param, failure.value.body


def test_fields_that_change_nothing_are_accepted(stack):
    reply = stack.sdk().chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        user="u-1",
        metadata={"team": "a"},
        store=False,
        parallel_tool_calls=False,
        n=1,
        tool_choice="none",
        response_format={"type": "text"},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_replica_side_errors_keep_their_status_streamed_or_not(stack):
    sdk = stack.sdk()
    too_long = {"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as failure:
            sdk.completions.create(**too_long, stream=stream)
        assert "max_model_len" in failure.value.message and failure.value.param == "prompt"
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.completions.create(model="no-such-model", prompt="x")
    assert unknown.value.param == "model"


def test_a_passed_deadline_is_504(stack):
    sdk = stack.sdk()
    with pytest.raises(openai.APIStatusError) as failure:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_headers={"X-Conveyor-Timeout-S": "0.001"})
    assert failure.value.status_code == 504 and failure.value.code == "deadline_exceeded"
    # while it streams: an error event, then [DONE] (the SDK raises APIError); the deadline
    # falls a third of the way through the stream, however fast this CPU runs it
    started = time.monotonic()
    for _ in sdk.completions.create(**long_request()):
        pass
    timeout_s = (time.monotonic() - started) / 3
    with pytest.raises(openai.APIError) as mid_stream:
        for _ in sdk.completions.create(**long_request(), extra_headers={"X-Conveyor-Timeout-S": f"{timeout_s:.3f}"}):
            pass
    assert mid_stream.value.code == "deadline_exceeded"


def test_a_full_queue_is_429(stack):
    """The replicas' bound (the limits hash) and the gateway's own --max-queue-len. The
    replicas are paused (SIGSTOP), so the job holding the queue stays queued."""
    for replica in stack.replicas:
        replica.pause()
    try:
        holder = Client(stack.redis_url, namespace=stack.ns).submit(prompt="x", model=MODEL, max_tokens=2)
        stack.raw.hset(stack.keys.limits, "max_queue_len", 1)
        with pytest.raises(openai.RateLimitError) as operator_bound:
            stack.sdk().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert operator_bound.value.code == "queue_full"
        stack.raw.delete(stack.keys.limits)
        with GatewayThread(stack.redis_url, stack.ns, max_queue_len=1) as own_bound:  # no keys: no auth
            with pytest.raises(openai.RateLimitError):
                openai_client(own_bound).completions.create(model=MODEL, prompt="x", max_tokens=2)
        holder.cancel()
    finally:
        stack.raw.delete(stack.keys.limits)
        for replica in stack.replicas:
            replica.resume()
    assert stack.sdk().completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_keys_file_without_keys_is_refused(tmp_path, redis_url):
    (tmp_path / "keys.json").write_text("{}")
    gateway = GatewayProcess(redis_url, tmp_path, keys_file=tmp_path / "keys.json", entry=LIGHT_GATEWAY).start()
    assert gateway.process.wait(60) == 2
    assert "refusing to run without auth" in gateway.log_text()


def test_the_gateway_imports_no_engine_code():
    code = (
        "import sys, conveyor.gateway.server, conveyor.gateway.cli\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.split('.')[:2] in (['conveyor', 'engine'], ['conveyor', 'actors']))\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


# ---------------------------------------------------------------- disconnects


def _stream_then_close(stack, headers=None) -> str:
    """Open a long stream, read until some text arrived, close it; returns the job id."""
    body = {
        "model": MODEL,
        "prompt": "def main():",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    auth = {"Authorization": f"Bearer {MAIN_KEY}", **(headers or {})}
    with httpx.stream("POST", f"{stack.gateway.base_url}/completions", json=body, headers=auth, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        job_id = reply.headers["x-conveyor-job-id"]
        lines = reply.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
    return job_id


def test_a_closed_stream_cancels_its_job(stack):
    job_id = _stream_then_close(stack)
    wait_until(lambda: stack.status(job_id) == "cancelled", 15, "the job to be cancelled")


def test_a_client_leaving_a_plain_request_cancels_its_job(stack):
    before = stack.job_ids()
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{stack.gateway.base_url}/completions",
            json=body,
            timeout=httpx.Timeout(60, read=0.5),
            headers={"Authorization": f"Bearer {MAIN_KEY}"},
        )
    [job_id] = stack.job_ids() - before
    wait_until(lambda: stack.status(job_id) == "cancelled", 15, "the job to be cancelled")


def test_keep_on_disconnect_lets_the_job_finish(stack):
    job_id = _stream_then_close(stack, {"X-Conveyor-Keep-On-Disconnect": "true"})
    result = Client(stack.redis_url, namespace=stack.ns).job(job_id).result(timeout=60)
    assert len(result.token_ids) == 900 and stack.status(job_id) == "done"


# ---------------------------------------------------------------- crash of the replica mid-stream (kills one)


def _owner(stack, job_id: str) -> ServeProcess:
    """The replica holding the job's request entry (on the model's own streams)."""

    def holder():
        for stream in stack.keys.all_model_requests(MODEL):
            for item in stack.raw.xpending_range(stream, GROUP, min="-", max="+", count=100):
                return item["consumer"].decode()

    name = wait_until(holder, 10, f"an owner of job {job_id}")
    return next(r for r in stack.replicas if r.consumer == name)


def test_stream_survives_kill9_of_the_replica_running_its_job(stack):
    """Sampled (temperature 0.8, no seed given: the gateway picks one), so only a rerun with
    the same seed gives the same text: the client must see one continuous stream."""
    sdk = stack.sdk()
    stream = sdk.completions.create(**long_request(temperature=0.8))
    job_id = stream.response.headers["x-conveyor-job-id"]
    text, chunks, victim = "", 0, None
    for chunk in stream:
        text += chunk.choices[0].text
        chunks += 1
        if chunks == 5:
            victim = _owner(stack, job_id)
            victim.kill9()
            killed_at = time.monotonic()
    assert victim is not None
    result = Client(stack.redis_url, namespace=stack.ns).job(job_id).result(timeout=10)
    record = JobLedger(stack.raw, stack.ns).record(job_id)
    check_attempt_sequences(record)
    first_attempt = [t for e in record.tokens_of(1) for t in e.token_ids]
    assert result.attempt == 2 and len(result.token_ids) == 900
    assert 0 < len(first_attempt) < 900, "the job must be cut short by the kill"
    assert result.token_ids[: len(first_attempt)] == first_attempt  # the same seed: the same tokens
    assert result.resumed_tokens == len(first_attempt)  # attempt 2 continued them (actors/resume.py)
    assert text == result.text  # nothing duplicated, nothing missing
    assert time.monotonic() - killed_at < 60


def test_usage_reports_cached_prompt_tokens_within_one_cache_salt(stack):
    """vLLM's ``cache_salt`` passes through to the job; ``prompt_tokens_details.cached_tokens``
    says how much of the prompt the prefix cache served. Two replicas: of three requests of
    one salt, two reach the same replica, and the later of them reads the prompt's full blocks."""
    salt, fresh = f"s-{uuid.uuid4().hex}", f"f-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]

    def cached(cache_salt: str) -> int:
        with openai_client(stack.gateway, MAIN_KEY) as sdk:
            reply = sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"cache_salt": cache_salt}
            )
        assert reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens

    assert max(cached(salt) for _ in range(3)) > 0
    assert cached(fresh) == 0, "another salt never reads them"


def test_usage_api_reports_the_replicas_counters_per_project_and_model(stack):
    """OpenAI's usage API shape over the counters `conveyor usage` reads: a tenant key sees
    its own project, an admin key every configured one."""
    with openai_client(stack.gateway, MAIN_KEY) as sdk:
        sdk.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    today = datetime.datetime.now(datetime.timezone.utc).date()  # the job's billing day (taken after it)
    [want], _ = read_usage(stack.raw, stack.keys, today, today)
    midnight = int(datetime.datetime(today.year, today.month, today.day, tzinfo=datetime.timezone.utc).timestamp())
    url = f"{stack.gateway.url}/v1/organization/usage/completions"

    def usage(key: str, **params) -> httpx.Response:
        params = {"start_time": midnight, **params}
        return httpx.get(url, params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    page = usage(MAIN_KEY, group_by=["project_id", "model"]).json()
    assert page["object"] == "page" and page["has_more"] is False
    [bucket] = page["data"]
    assert bucket["start_time"] == midnight and bucket["end_time"] == midnight + 86_400
    [result] = bucket["results"]
    assert (result["project_id"], result["model"]) == (stack.ns, MODEL)
    counted = (result["num_model_requests"], result["input_tokens"], result["output_tokens"])
    assert counted == (want.jobs, want.prompt_tokens, want.completion_tokens)
    assert result["input_cached_tokens"] == want.cached_tokens
    admin = usage(ADMIN_KEY, group_by="project_id").json()["data"][0]["results"]
    assert {r["project_id"]: r["num_model_requests"] for r in admin} == {stack.ns: want.jobs}, "empty projects add none"
    assert usage(EMPTY_KEY).json()["data"][0]["results"] == [], "a tenant sees only its own"
    assert usage(EMPTY_KEY, project_ids=stack.ns).status_code == 403
    refused = usage(MAIN_KEY, bucket_width="1h")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bucket_width"
    for name, bad in (("start_time", "soon"), ("start_time", "\u00b2"), ("start_time", "999999999999"), ("limit", "0")):
        assert usage(MAIN_KEY, **{name: bad}).json()["error"]["param"] == name, (name, bad)


def test_a_hostile_cache_salt_is_refused_naming_the_field(stack):
    with openai_client(stack.gateway, MAIN_KEY) as sdk:
        for hostile in ("x" * 257, "", 7, ["s"], {"s": 1}):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": hostile})
            assert "cache_salt" in str(refused.value), hostile
