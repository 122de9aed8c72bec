"""The language-neutral payload digest and the documented submit script.

docs/protocol.md carries the digest's test vectors, its JavaScript reference and the
submit script's Lua text; these tests hold the doc to the code (and, where `node` is
installed, the JavaScript reference to the Python one). The submit-script tests run
against a real Valkey/Redis server.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.clients import AsyncClient, Client, InvalidJob, QueueFull, decode_job
from conveyor.clients.job_record import SUBMIT_LUA
from conveyor.clients.keys import Keys
from conveyor.clients.protocol import (
    DEFAULT_ONLY_DIGEST_FIELDS,
    DIGEST_FIELDS,
    OPTIONAL_DIGEST_FIELDS,
    JobRequest,
    _js_number,
    digest_input,
    encode_job,
    payload_digest,
)
from conveyor.clients.submission import submit_args

DOC = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")


def doc_block(marker: str) -> str:
    """The fenced block that follows `<!-- marker ... -->` in docs/protocol.md."""
    match = re.search(rf"<!-- {re.escape(marker)}[^>]*-->\n```[a-z]*\n(.*?)\n```", DOC, re.S)
    assert match, f"docs/protocol.md has no block after <!-- {marker} -->"
    return match.group(1)


def doc_vectors() -> list[tuple[str, str]]:
    table = DOC[DOC.index("<!-- digest-vectors -->") :]
    rows = re.findall(r"^\| `(\{.*\})` \| `([0-9a-f]{64})` \|$", table.split("\n\n")[0], re.M)
    assert len(rows) >= 3
    return rows


def digest_of(payload: dict | str) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return payload_digest(decode_job({"json": text}, "1-0"))


# ---------------------------------------------------------------- the digest


@pytest.mark.parametrize("payload, digest", doc_vectors())
def test_doc_vectors_match_the_code(payload, digest):
    assert digest_of(payload) == digest


def test_doc_shows_the_text_hashed_for_the_first_vector():
    first = doc_vectors()[0][0]
    assert doc_block("digest-input") == digest_input(decode_job({"json": first}))


def test_defaults_and_normalisations_do_not_change_the_digest():
    base = digest_of({"prompt": "hi"})
    same = [
        {"prompt": "hi", "max_tokens": 16},
        {"prompt": "hi", "temperature": 1, "top_p": 1.0, "top_k": -1, "stop": None, "stop_token_ids": None},
        {"prompt": "hi", "seed": None, "logprobs": None, "model": None, "presence_penalty": -0.0},
        {"prompt": "hi", "n": 1},  # n joined the digest later: at its default it is left out
        # scheduling, delivery and bookkeeping are not part of what the job asks for
        {
            "prompt": "hi",
            "job_id": "other",
            "v": 1,
            "priority_class": "batch",
            "priority": -3,
            "deadline": time.time() + 60,
            "result_ttl": 5,
            "metadata": {"k": [1, 2]},
        },
    ]
    assert [digest_of(p) for p in same] == [base] * len(same)
    assert digest_of({"prompt": "hi", "stop": "x"}) == digest_of({"prompt": "hi", "stop": ["x"]})
    chat = [{"role": "user", "content": "hi"}]
    assert digest_of({"messages": chat}) == digest_of({"messages": [{**chat[0], "name": "ignored"}]})


@pytest.mark.parametrize(
    "change",
    [
        {"prompt": "hi!"},
        {"max_tokens": 17},
        {"temperature": 0.5},
        {"top_p": 0.9},
        {"top_k": 5},
        {"min_p": 0.1},
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"seed": 0},
        {"stop": ["x"]},
        {"stop_token_ids": [2]},
        {"ignore_eos": True},
        {"min_tokens": 1},
        {"logprobs": 0},
        {"model": "m"},
        {"n": 2},
    ],
)
def test_every_digest_field_changes_the_digest(change):
    assert digest_of({"prompt": "hi", **change}) != digest_of({"prompt": "hi"})


def test_structured_outputs_count_only_when_given():
    base = digest_of({"prompt": "hi"})
    assert digest_of({"prompt": "hi", "structured_outputs": None}) == base
    regex = digest_of({"prompt": "hi", "structured_outputs": {"regex": "a+"}})
    assert regex != base
    assert (
        digest_of(
            {"prompt": "hi", "structured_outputs": {"regex": "a+", "json": None, "disable_any_whitespace": False}}
        )
        == regex
    )
    assert digest_of({"prompt": "hi", "structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}) != regex
    assert digest_of({"prompt": "hi", "structured_outputs": {"regex": "a*"}}) != regex


def test_the_prompt_kind_is_part_of_the_digest():
    digests = {
        digest_of({"prompt": "1"}),
        digest_of({"prompt_token_ids": [1]}),
        digest_of({"messages": [{"role": "user", "content": "1"}]}),
    }
    assert len(digests) == 3


def test_digest_fields_are_the_documented_eighteen():
    assert len(DIGEST_FIELDS) == 18 and len(set(DIGEST_FIELDS)) == 18
    section = DOC[DOC.index("### Payload digest") : DOC.index("Not part of it")]
    assert all(
        f"`{name}`" in section for name in (*DIGEST_FIELDS, *DEFAULT_ONLY_DIGEST_FIELDS, *OPTIONAL_DIGEST_FIELDS)
    )
    rest = (
        set(JobRequest.model_fields)
        - set(DIGEST_FIELDS)
        - set(DEFAULT_ONLY_DIGEST_FIELDS)
        - set(OPTIONAL_DIGEST_FIELDS)
    )
    not_part = DOC[DOC.index("Not part of it") : DOC.index("Canonical JSON")]
    assert all(f"`{name}`" in not_part for name in rest), rest


def test_digest_text_is_ascii_with_sorted_keys_and_no_whitespace():
    job = decode_job({"json": json.dumps({"prompt": 'Grüß 👋\n"q"\x01\x7f', "temperature": 0.25})})
    text = digest_input(job)
    assert text.isascii() and '": ' not in text and '", ' not in text
    parsed = json.loads(text)
    assert list(parsed) == sorted(parsed) and parsed["prompt"] == job.prompt
    assert '"temperature":0.25' in text and '"max_tokens":16' in text and text.endswith('"top_p":1}')
    assert len(payload_digest(job)) == 64


@pytest.mark.parametrize(
    "value, text",
    [
        (1.0, "1"),
        (-0.0, "0"),
        (0.1, "0.1"),
        (1.5e-5, "0.000015"),
        (1e-7, "1e-7"),
        (1.25e-7, "1.25e-7"),
        (1e20, "100000000000000000000"),
        (1e21, "1e+21"),
        (1.2345e22, "1.2345e+22"),
        (-2.5, "-2.5"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (123456.789, "123456.789"),
    ],
)
def test_floats_are_written_as_javascript_writes_them(value, text):
    assert _js_number(value) == text
    assert float(text) == value


def test_seed_range_is_the_engines():
    assert validate_seed(0) == 0 and validate_seed(2**63 - 1) == 2**63 - 1
    for bad in (-1, 2**63, -(2**63)):
        with pytest.raises(InvalidJob) as info:
            validate_seed(bad)
        assert info.value.field == "seed"
    assert "| `seed` | int or null | null | 0..2^63-1" in DOC


def validate_seed(seed: int) -> int:
    return decode_job({"data": msgpack.packb({"prompt": "x", "seed": seed})}).seed


# ---------------------------------------------------------------- the JavaScript reference


def run_js_digests(payloads: list[dict]) -> list[str]:
    """The doc's JavaScript reference, run by node on each payload (a JSON line each;
    a seed written as a string becomes a BigInt, as a Node producer would send it)."""
    harness = (
        doc_block("payload-digest.js")
        + """
import { readFileSync } from "node:fs";
for (const line of readFileSync(0, "utf8").split("\\n").filter(Boolean)) {
  const job = JSON.parse(line);
  if (typeof job.seed === "string") job.seed = BigInt(job.seed);
  console.log(payloadDigest(job));
}
"""
    )
    lines = "\n".join(json.dumps(p) for p in payloads) + "\n"
    done = subprocess.run(
        [NODE, "--input-type=module", "-e", harness],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()


@needs_node
def test_js_reference_matches_the_doc_vectors():
    vectors = doc_vectors()
    assert run_js_digests([json.loads(p) for p, _ in vectors]) == [d for _, d in vectors]


@needs_node
def test_js_reference_handles_bigint_seeds():
    seed = 2**63 - 1
    assert run_js_digests([{"prompt": "x", "seed": str(seed)}]) == [digest_of({"prompt": "x", "seed": seed})]


finite = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=40)
words = texts.filter(bool)
payloads = st.fixed_dictionaries(
    {"prompt": words},
    optional={
        "temperature": st.floats(min_value=0.0, max_value=100.0),
        "top_p": st.floats(min_value=1e-9, max_value=1.0),
        "min_p": st.floats(min_value=0.0, max_value=1.0),
        "repetition_penalty": st.floats(min_value=0.01, max_value=100.0),
        "presence_penalty": st.floats(min_value=-2.0, max_value=2.0),
        "frequency_penalty": st.sampled_from([0.0, -0.0, 1e-7, 2.0, -1.9999999999999998, 0.1 + 0.2]),
        "max_tokens": st.integers(min_value=1, max_value=2**31 - 1),
        "top_k": st.integers(-1, 100),
        "seed": st.integers(0, 2**53 - 1),
        "stop": st.one_of(words, st.lists(words, max_size=5)),
        "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "model": st.one_of(st.none(), words),
        "n": st.integers(1, 16),
        "structured_outputs": st.sampled_from(
            [
                None,
                {"regex": "a+"},
                {"choice": ["x", "y"], "disable_any_whitespace": True},
                {"json": {"type": "object", "properties": {"n": {"maximum": 1.5, "minimum": -0.0}}}, "regex": None},
                {"json": '{"type": "string"}'},
                {"json_object": True, "disable_any_whitespace": False},
            ]
        ),
    },
)


@needs_node
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(payloads, min_size=10, max_size=40))
def test_js_reference_agrees_with_python_on_random_jobs(batch):
    assert run_js_digests(batch) == [digest_of(p) for p in batch]


@needs_node
def test_js_number_formatting_agrees_with_node_on_random_floats():
    import random

    rng = random.Random(7)
    values = [rng.uniform(-1, 1) * 10 ** rng.randint(-330, 308) for _ in range(3000)]
    values += [float(rng.randint(0, 10**22)) for _ in range(300)] + [2.0**k for k in range(-1074, 1024, 7)]
    values = [v for v in values if math.isfinite(v)]
    script = "for (const x of JSON.parse(require('fs').readFileSync(0,'utf8'))) console.log(String(x))"
    done = subprocess.run(
        [NODE, "-e", script], input=json.dumps(values), capture_output=True, text=True, timeout=60, check=True
    )
    assert [_js_number(v) for v in values] == done.stdout.split()


# ---------------------------------------------------------------- the submit script


def test_doc_prints_the_submit_script_the_clients_run():
    assert doc_block("submit.lua") == SUBMIT_LUA.strip()


def test_submit_args_follow_the_documented_keys_and_argv():
    keys, job = Keys("ns"), JobRequest(job_id="j", prompt="hi", model="m", result_ttl=60)
    script_keys, argv = submit_args(keys, job, 5)
    assert script_keys == ["ns:job:j", "ns:requests:interactive:m", "ns:out:j", "ns:limits"]
    assert argv[0] == encode_job(job)["data"]  # the fields the job set (unset sampling fields: the model's)
    assert argv[1:2] == [60] and float(argv[2]) == pytest.approx(time.time(), abs=5)
    assert argv[3:] == [5, payload_digest(job)]


@pytest.fixture
def client(redis_url, namespace):
    with Client(redis_url, namespace) as c:
        yield c


def write_refusal(raw, keys: Keys, job_id: str) -> None:
    """What a replica leaves for an entry it could not read: an error event + a 'rejected' hash."""
    raw.xadd(
        keys.out(job_id),
        {
            "type": "error",
            "data": msgpack.packb(
                {"type": "error", "attempt": 1, "code": "invalid_job", "message": "bad", "rejected_entry": "1-1"}
            ),
        },
    )
    raw.hset(keys.job(job_id), mapping={"status": "rejected", "rejected": "1", "entry": "1-1", "updated": "1"})
    raw.expire(keys.job(job_id), 3600)
    raw.expire(keys.out(job_id), 3600)


def test_a_refusal_record_does_not_block_a_later_valid_submit(client, raw):
    keys = client.keys
    write_refusal(raw, keys, "r1")
    assert client.job("r1").cancel() is False  # a refusal is not a job to cancel
    job = client.submit("hi", job_id="r1")
    assert job.enqueued
    record = raw.hgetall(keys.job("r1"))
    assert record[b"status"] == b"queued" and b"rejected" not in record and b"cancel" not in record
    assert record[b"digest"].decode() == digest_of({"prompt": "hi"})
    assert record[b"entry"] == raw.xrange(keys.interactive)[0][0]
    assert not raw.exists(keys.out("r1"))  # the refusal's error event is gone with it
    assert client.submit("hi", job_id="r1").enqueued is False  # and now the id is taken


def test_a_refusal_record_survives_a_submit_that_found_the_queue_full(client, raw):
    keys = client.keys
    client.submit("a", max_queue_len=1)
    write_refusal(raw, keys, "r2")
    with pytest.raises(QueueFull):
        client.submit("hi", job_id="r2", max_queue_len=1)
    assert raw.hget(keys.job("r2"), "status") == b"rejected" and raw.xlen(keys.out("r2")) == 1


def test_other_records_are_never_replaced(client, raw):
    keys = client.keys
    for status in ("queued", "running", "done", "error", "cancelled"):
        raw.hset(keys.job(f"s-{status}"), mapping={"status": status, "attempt": "1"})
        assert client.submit("hi", job_id=f"s-{status}").enqueued is False
        assert raw.hget(keys.job(f"s-{status}"), "status") == status.encode()
    assert raw.xlen(keys.interactive) == 0


def test_the_operators_queue_bound_applies_to_every_producer(client, raw):
    keys = client.keys
    raw.hset(keys.limits, "max_queue_len", 2)
    client.submit("a")
    client.submit("b")
    with pytest.raises(QueueFull) as info:
        client.submit("c")
    assert "server's queue bound" in info.value.message and keys.limits in info.value.message
    with pytest.raises(QueueFull, match="server's queue bound"):  # the caller cannot lift it
        client.submit("c", max_queue_len=100)
    with pytest.raises(QueueFull, match=r"the caller's max_queue_len=1\b"):  # the smaller bound wins
        client.submit("c", max_queue_len=1)
    with pytest.raises(QueueFull, match=r"the caller's max_queue_len=2\b"):  # a tie names the caller's
        client.submit("c", max_queue_len=2)
    assert raw.xlen(keys.interactive) == 2


def test_submit_many_reports_the_operators_bound(client, raw):
    raw.hset(client.keys.limits, "max_queue_len", 3)
    with pytest.raises(QueueFull, match="server's queue bound") as info:
        client.submit_many([{"prompt": str(i)} for i in range(5)], progress=False)
    assert len(info.value.submitted) == 3


@pytest.mark.parametrize("value", ["0", "-5", "not a number", "", "nan"])
def test_no_usable_operator_bound_means_unbounded(client, raw, value):
    raw.hset(client.keys.limits, "max_queue_len", value)
    for i in range(4):
        client.submit(str(i))
    assert raw.xlen(client.keys.interactive) == 4


def test_a_limits_key_of_another_type_is_no_bound(client, raw):
    raw.set(client.keys.limits, "5")  # a producer clobbered it: submits still work
    for i in range(6):
        client.submit(str(i))
    assert raw.xlen(client.keys.interactive) == 6


def test_async_client_reports_the_operators_bound(redis_url, namespace, raw):
    import asyncio

    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            raw.hset(client.keys.limits, "max_queue_len", 1)
            await client.submit("a")
            with pytest.raises(QueueFull, match="server's queue bound"):
                await client.submit("b")

    asyncio.run(scenario())


def test_script_with_json_field_and_no_digest(client, raw):
    """What a redis-cli or JSON-only producer does: ARGV[6] = 'json', digest ''."""
    keys = client.keys
    payload = json.dumps({"job_id": "cli-1", "prompt": "Say hi", "max_tokens": 8})
    script_keys = [keys.job("cli-1"), keys.interactive, keys.out("cli-1"), keys.limits]
    argv = [payload, 86400, repr(time.time()), 0, "", "json"]
    assert raw.eval(SUBMIT_LUA, 4, *script_keys, *argv) == 1
    ((entry_id, fields),) = raw.xrange(keys.interactive)
    assert set(fields) == {b"json"} and decode_job(fields, entry_id).job_id == "cli-1"
    assert b"digest" not in raw.hgetall(keys.job("cli-1"))
    assert raw.eval(SUBMIT_LUA, 4, *script_keys, *argv) == 0  # idempotent
    other = submit_args(keys, JobRequest(job_id="cli-1", prompt="something else"), None)
    assert raw.eval(SUBMIT_LUA, 4, *other[0], *other[1]) == 0  # nothing stored to conflict with
    with pytest.raises(Exception, match="data or json"):
        raw.eval(SUBMIT_LUA, 4, *script_keys, *argv[:5], "other")


def test_reused_id_with_another_payload_is_a_conflict(client):
    from conveyor.clients import JobConflict

    client.submit("x", job_id="c1", priority_class="batch")
    assert client.submit("x", job_id="c1").enqueued is False  # priority_class is not in the digest
    with pytest.raises(JobConflict):
        client.submit("x", job_id="c1", temperature=0.5)
