"""Wire protocol: job schema, request-entry codec, events. No server needed."""

from __future__ import annotations

import ast
import json
import math
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.clients.errors import InvalidJob, ProtocolError
from conveyor.clients.protocol import (
    MAX_PROMPT_CHARS,
    CancelledEvent,
    DoneEvent,
    ErrorEvent,
    JobRequest,
    TokenEvent,
    decode_event,
    decode_event_data,
    decode_job,
    encode_event,
    encode_job,
    validate_job,
)

VLLM_SAMPLING_PARAM_NAMES = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logprobs",
    "n",
    "structured_outputs",
}


def msgpack_entry(payload) -> dict[bytes, bytes]:
    return {b"data": msgpack.packb(payload)}


def json_entry(payload) -> dict[bytes, bytes]:
    return {b"json": json.dumps(payload).encode()}


# ---------------------------------------------------------------- round trips


def test_msgpack_round_trip_keeps_every_field():
    job = JobRequest(
        job_id="doc-1:part.2",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=7,
        temperature=0.5,
        top_k=40,
        seed=3,
        stop=["\n\n"],
        stop_token_ids=[2],
        logprobs=2,
        priority_class="batch",
        priority=-1,
        deadline=time.time() + 60,
        result_ttl=60,
        metadata={"doc": 1, "tags": ["a"]},
    )
    fields = encode_job(job)
    assert set(fields) == {"data"} and isinstance(fields["data"], bytes)
    assert decode_job({k.encode(): v for k, v in fields.items()}) == job


def test_json_field_is_accepted_with_bytes_or_str_keys():
    assert decode_job(json_entry({"job_id": "j1", "prompt": "hi"})).prompt == "hi"
    assert decode_job({"json": '{"job_id": "j2", "prompt_token_ids": [1, 2]}'}).prompt_token_ids == [1, 2]
    chat = decode_job(json_entry({"messages": [{"role": "user", "content": "hi", "name": "x"}]}))
    assert chat.chat_messages() == [{"role": "user", "content": "hi"}]


def test_defaults_are_vllm_defaults():
    job = decode_job(json_entry({"prompt": "hi"}))
    assert job.sampling_params() == {
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": None,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "min_tokens": 0,
        "logprobs": None,
        "n": 1,
        "structured_outputs": None,
    }
    assert (job.v, job.priority_class, job.priority, job.result_ttl) == (1, "interactive", 0, 86400)
    assert len(job.job_id) == 32


def test_sampling_params_uses_exactly_vllm_names():
    assert set(JobRequest(prompt="x").sampling_params()) == VLLM_SAMPLING_PARAM_NAMES


def test_normalisations():
    job = JobRequest(prompt="x", stop="END", top_k=-1, temperature=1)
    assert job.stop == ["END"] and job.top_k == 0 and isinstance(job.temperature, float)
    assert JobRequest(prompt="x", stop=None).stop == []


def test_unknown_fields_are_ignored():
    job = decode_job(msgpack_entry({"prompt": "hi", "beam_width": 4, "best_of": 2, "future_thing": {"a": 1}}))
    assert job.prompt == "hi" and not hasattr(job, "future_thing")


def test_missing_job_id_falls_back_to_entry_id():
    assert decode_job(json_entry({"prompt": "hi"}), entry_id=b"1700000000000-0").job_id == "1700000000000-0"
    assert decode_job(json_entry({"prompt": "hi", "job_id": "mine"}), entry_id="1-0").job_id == "mine"


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, field, limit",
    [
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than or equal to 0.01"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": math.nan}, "frequency_penalty", "finite"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "<= max_tokens (10)"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"result_ttl": 0}, "result_ttl", "greater than or equal to 1"),
        ({"result_ttl": 31 * 86400}, "result_ttl", "less than or equal to 2592000"),
        ({"deadline": 30.0}, "deadline", "absolute epoch seconds"),
        ({"priority_class": "urgent"}, "priority_class", "'interactive' or 'batch'"),
        ({"job_id": "has space"}, "job_id", "pattern"),
        ({"job_id": "x" * 129}, "job_id", "pattern"),
        ({"job_id": ""}, "job_id", "pattern"),
        ({"prompt": ""}, "prompt", "at least 1 character"),
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt", f"at most {MAX_PROMPT_CHARS}"),
        ({"stop": [""]}, "stop[0]", "at least 1 character"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than or equal to 0"),
        ({"seed": 2**64}, "seed", "less than or equal to"),
        ({"metadata": {"blob": "x" * 70_000}}, "metadata", "limit 65536"),
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"max_tokens": 5.0}, "max_tokens", "valid integer"),
        ({"max_tokens": True}, "max_tokens", "valid integer"),
        ({"temperature": "0.5"}, "temperature", "valid number"),
        ({"ignore_eos": 1}, "ignore_eos", "valid boolean"),
        ({"v": 0}, "v", "greater than or equal to 1"),
    ],
)
def test_validation_errors_name_field_and_limit(overrides, field, limit):
    payload = {"job_id": "j-1", "prompt": "hi", **overrides}
    for entry in encodable_entries(payload):
        with pytest.raises(InvalidJob) as info:
            decode_job(entry)
        assert info.value.field == field
        assert field in info.value.message and limit in info.value.message
        assert info.value.code == "invalid_job"


def encodable_entries(payload) -> list[dict[bytes, bytes]]:
    """The payload as a msgpack entry and as a JSON entry, where each format can carry it."""
    entries = []
    if not any(isinstance(v, int) and v >= 2**64 for v in payload.values()):
        entries.append(msgpack_entry(payload))
    if all(math.isfinite(v) for v in payload.values() if isinstance(v, float)):
        entries.append(json_entry(payload))
    return entries


@pytest.mark.parametrize(
    "payload, field",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt_token_ids"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids[1]"),
    ],
)
def test_prompt_rules(payload, field):
    with pytest.raises(InvalidJob) as info:
        validate_job(payload)
    assert info.value.field == field and field in info.value.message


def test_exactly_one_prompt_message_lists_what_was_given():
    with pytest.raises(InvalidJob, match="exactly one of prompt, messages, prompt_token_ids.*got none"):
        validate_job({"max_tokens": 3})


def test_ints_are_accepted_for_floats():
    job = validate_job({"prompt": "x", "temperature": 0, "top_p": 1, "deadline": 2_000_000_000})
    assert job.temperature == 0.0 and job.deadline == 2e9


def test_invalid_job_keeps_readable_job_id():
    with pytest.raises(InvalidJob) as info:
        decode_job(msgpack_entry({"job_id": "keep-me", "prompt": "x", "max_tokens": -5}))
    assert info.value.job_id == "keep-me"


def test_ten_megabyte_prompt_is_rejected_cheaply_with_job_id():
    huge = "x" * 10_000_000
    for entry, code in [
        (msgpack_entry({"job_id": "big", "prompt": huge}), "too_large"),
        (json_entry({"job_id": "big", "prompt": huge}), "too_large"),
    ]:
        started = time.perf_counter()
        with pytest.raises(ProtocolError) as info:
            decode_job(entry)
        assert time.perf_counter() - started < 0.5
        assert (info.value.code, info.value.job_id) == (code, "big")
    with pytest.raises(InvalidJob, match="prompt: String should have at most 1000000"):
        validate_job({"prompt": huge})


# ---------------------------------------------------------------- broken entries


@pytest.mark.parametrize(
    "fields, code",
    [
        ({b"other": b"x"}, "bad_encoding"),
        ({b"data": b"\xc1"}, "bad_encoding"),  # reserved msgpack byte
        ({b"data": msgpack.packb([1, 2])}, "bad_encoding"),
        ({b"data": msgpack.packb({1: "x"})}, "bad_encoding"),  # non-string map key
        ({b"json": b"{not json"}, "bad_encoding"),
        ({b"json": b'"just a string"'}, "bad_encoding"),
        ({b"json": b'{"prompt": "x", "temperature": NaN}'}, "bad_encoding"),
        ({b"json": b"\xff\xfe"}, "bad_encoding"),
        ({b"data": b"\x91" * 5000}, "bad_encoding"),  # nesting deeper than the unpacker stack
        ({b"data": b"\xdd\xff\xff\xff\xff"}, "bad_encoding"),  # array header claiming 4G items
        ({b"json": b"[" * 100_000}, "bad_encoding"),
        ({b"data": msgpack.packb({"v": 2, "prompt": "x"})}, "unsupported_version"),
    ],
)
def test_broken_entries_raise_protocol_error(fields, code):
    with pytest.raises(ProtocolError) as info:
        decode_job(fields)
    assert info.value.code == code and info.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {b"data": msgpack.packb({"prompt": "x", "metadata": {"k": [[[]] * 200_000, [[]] * 200_000]}})},
        {b"json": b'{"prompt": "x", "metadata": {"k": [' + b"[]," * 400_000 + b"[]]}}"},
        {b"json": b'{"prompt": "x", "metadata": {"k": [' + b'"ab",' * 400_000 + b'"a"]}}'},
    ],
)
def test_many_tiny_values_are_rejected_before_building_them(fields):
    with pytest.raises(ProtocolError) as info:
        decode_job(fields)
    assert info.value.code == "too_large"


def test_separators_inside_json_strings_do_not_count_as_elements():
    prompt = 'a,[{"' * 120_000  # 360k separators (over the element budget), all inside one string
    assert decode_job(json_entry({"prompt": prompt})).prompt == prompt


def test_broken_msgpack_still_yields_job_id():
    raw = msgpack.packb({"job_id": "salvage", "prompt": "x"}) + b"\xc1"
    with pytest.raises(ProtocolError) as info:
        decode_job({b"data": raw[:-6]})  # truncated
    assert info.value.job_id == "salvage"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
job_like = st.dictionaries(
    st.sampled_from(sorted(JobRequest.model_fields) + ["extra", "type"]), json_values, max_size=8
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=200), field=st.sampled_from([b"data", b"json"]))
def test_fuzz_random_bytes_only_raise_protocol_error(raw, field):
    try:
        decode_job({field: raw})
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=json_values | job_like)
def test_fuzz_random_msgpack_only_raises_protocol_error(payload):
    try:
        job = decode_job({b"data": msgpack.packb(payload)})
    except ProtocolError:
        return
    assert decode_job(encode_job(job)) == job


@settings(max_examples=200, deadline=None)
@given(payload=job_like, prompt=st.text(min_size=1, max_size=50))
def test_fuzz_json_jobs_round_trip_or_fail_cleanly(payload, prompt):
    payload = {**payload, "prompt": prompt}
    try:
        job = decode_job({b"json": json.dumps(payload).encode()})
    except ProtocolError as exc:
        assert exc.message
        return
    assert job.prompt == prompt


# ---------------------------------------------------------------- events


@pytest.mark.parametrize(
    "event",
    [
        TokenEvent(attempt=1, seq=0, text="Hel", token_ids=[5, 6], logprobs=[{"5": -0.1}]),
        DoneEvent(
            attempt=2,
            seq=3,
            finish_reason="stop",
            text="Hello",
            token_ids=[5, 6, 7],
            usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            timings={"queue": 0.01, "ttft": 0.1, "tpot": 0.02, "e2e": 0.2},
            metadata={"m": 1},
        ),
        ErrorEvent(attempt=1, code="prompt_too_long", message="prompt: 9000 tokens, limit 8192"),
        CancelledEvent(attempt=1, metadata={"m": 2}),
    ],
)
def test_event_round_trip(event):
    fields = encode_event(event)
    assert fields["type"] == event.type.encode()
    decoded = decode_event({k.encode(): v for k, v in fields.items()}, entry_id=b"5-1")
    assert decoded == event.model_copy(update={"entry_id": "5-1"})
    assert decoded.entry_id == "5-1"
    assert decode_event_data(fields["data"]) == event  # data alone is self-describing


def test_event_without_type_in_data_uses_type_field():
    data = msgpack.packb({"attempt": 1, "seq": 0, "text": "a", "token_ids": [1]})
    assert isinstance(decode_event({b"type": b"token", b"data": data}), TokenEvent)


@pytest.mark.parametrize(
    "fields",
    [
        {b"type": b"token"},
        {b"type": b"token", b"data": b"\xc1"},
        {b"type": b"weird", b"data": msgpack.packb({"attempt": 1})},
        {b"type": b"token", b"data": msgpack.packb({"attempt": 0, "seq": 0})},
    ],
)
def test_bad_events_raise_protocol_error(fields):
    with pytest.raises(ProtocolError) as info:
        decode_event(fields)
    assert info.value.code == "bad_event"


# ---------------------------------------------------------------- dependency rule

FORBIDDEN_IMPORTS = ("torch", "transformers", "engine", "actors", "kernels")


def test_clients_never_import_heavy_or_inner_packages():
    clients_dir = Path(__file__).resolve().parents[1] / "clients"
    for path in clients_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN_IMPORTS, f"{path.name} imports {name}"
