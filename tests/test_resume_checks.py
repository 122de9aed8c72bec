"""What a taken-over job carries over (actors/resume.py Resumer.check), from out streams as a
replica, or a hostile writer of the namespace, left them: the published output is folded as
readers fold it, checked, and cut before any token that would already end the job."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conveyor.actors.resume import Resumer
from conveyor.clients.events import DoneEvent, TokenEvent, encode_event
from conveyor.clients.protocol import validate_job

IDENTITY = "model|vocab=512|files=x"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def resumer(tokenizer, max_resumes: int = 3, eos=(2,)) -> Resumer:
    return Resumer(tokenizer, eos, tokenizer.vocab_size, IDENTITY, max_resumes)


def entries_of(*events) -> list[tuple]:
    return [(f"{i + 1}-0", encode_event(event)) for i, event in enumerate(events)]


def token(attempt, seq, ids, text, **more) -> TokenEvent:
    return TokenEvent(attempt=attempt, seq=seq, token_ids=ids, text=text, **more)


def published(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def job(**fields):
    return validate_job({"prompt_token_ids": PROMPT, "max_tokens": 50, "temperature": 0, **fields})


def test_an_honest_output_is_carried_whole_across_reruns_and_resumes(tokenizer):
    ids = [30, 31, 32, 33, 34, 35]
    text = published(tokenizer, ids)
    entries = entries_of(
        token(1, 0, [99, 98], published(tokenizer, [99, 98])),  # attempt 1, then a rerun voids it
        token(2, 0, ids[:3], published(tokenizer, ids[:3])),
        token(2, 1, ids[3:], text[len(published(tokenizer, ids[:3])) :]),
    )
    carried = resumer(tokenizer).check(job(ignore_eos=True), PROMPT, 3, IDENTITY, entries)
    assert carried.reason is None and carried.token_ids == tuple(ids) and carried.chars == len(text)
    assert carried.note() == "resumed after 6 of 6 published tokens"
    # a later resumed attempt (attempt 3 kept 4 of them) is folded the same way
    more = entries + entries_of(
        token(
            3,
            0,
            [36],
            published(tokenizer, ids[:4] + [36])[len(published(tokenizer, ids[:4])) :],
            resumed_tokens=4,
            resumed_chars=len(published(tokenizer, ids[:4])),
        )
    )
    carried = resumer(tokenizer).check(job(ignore_eos=True), PROMPT, 4, IDENTITY, more[:3] + more[3:])
    assert carried.token_ids == tuple(ids[:4] + [36])


def test_tokens_that_would_already_end_the_job_are_sampled_again(tokenizer):
    ids = [30, 31, 2, 33]  # 2: EOS
    entries = entries_of(token(1, 0, ids, published(tokenizer, ids)))
    assert resumer(tokenizer).check(job(), PROMPT, 2, IDENTITY, entries).token_ids == (30, 31)
    assert resumer(tokenizer).check(job(ignore_eos=True), PROMPT, 2, IDENTITY, entries).token_ids == tuple(ids)
    assert resumer(tokenizer).check(job(stop_token_ids=[31]), PROMPT, 2, IDENTITY, entries).token_ids == (30,)
    assert resumer(tokenizer).check(job(max_tokens=4, ignore_eos=True), PROMPT, 2, IDENTITY, entries).token_ids == (
        30,
        31,
        2,
    )
    stop = published(tokenizer, ids[:2])[-1:]  # a stop string the published text completes
    carried = resumer(tokenizer).check(job(stop=[stop], ignore_eos=True), PROMPT, 2, IDENTITY, entries)
    assert len(carried.token_ids) < 2 and carried.reason is None


@pytest.mark.parametrize(
    "why, attempt, identity, events, fields, max_resumes",
    [
        ("resuming is off", 2, IDENTITY, [token(1, 0, [30], "x")], {}, 0),
        ("resumed 1 times already", 3, IDENTITY, [token(1, 0, [30], "x")], {}, 1),
        ("the earlier attempt ran", 2, "other|vocab=512|files=y", [token(1, 0, [30], "x")], {}, 3),
        ("unrecorded model", 2, None, [token(1, 0, [30], "x")], {}, 3),
        ("outside the vocabulary", 2, IDENTITY, [token(1, 0, [30, 10**9], "x")], {}, 3),
        ("more than max_tokens", 2, IDENTITY, [token(1, 0, [30] * 60, "x")], {}, 3),
        ("not what this replica's tokenizer makes", 2, IDENTITY, [token(1, 0, [30, 31], "forged text")], {}, 3),
        ("n > 1 reruns", 2, IDENTITY, [token(1, 0, [30], "x", index=1)], {"n": 2}, 3),
        ("terminal event", 2, IDENTITY, [token(1, 0, [30], "x"), DoneEvent(attempt=1, finish_reason="stop")], {}, 3),
    ],
)
def test_output_that_cannot_be_trusted_reruns_with_the_reason(
    tokenizer, why, attempt, identity, events, fields, max_resumes
):
    carried = resumer(tokenizer, max_resumes).check(job(**fields), PROMPT, attempt, identity, entries_of(*events))
    assert carried.token_ids == () and carried.chars == 0
    assert why in carried.reason and carried.note().startswith("rerun from the start: ")


def test_junk_entries_cost_a_rerun_or_nothing_never_an_error(tokenizer):
    junk = [("1-0", {b"type": b"token", b"data": b"\xc1"}), ("2-0", {b"nothing": b"here"})]
    carried = resumer(tokenizer).check(job(), PROMPT, 2, IDENTITY, junk)
    assert carried.token_ids == () and carried.reason.startswith("an event cannot be read")
    assert resumer(tokenizer).check(job(), PROMPT, 2, IDENTITY, []).note() == "resumed after 0 of 0 published tokens"


def test_a_clobbered_or_flooded_out_stream_is_read_as_nothing_to_trust(redis_url, namespace, raw):
    """Streams.published, the resume's one read of Redis: a key of another type, or more events
    than the bound, gives None (the job reruns), never an error or an unbounded read."""
    import asyncio

    import redis.asyncio as aioredis

    from conveyor.actors.streams import RESUME_READ_PAGE, Streams
    from conveyor.clients.keys import Keys

    keys = Keys(namespace)

    async def published(job_id: str, max_events: int):
        client = aioredis.from_url(redis_url)
        try:
            return await Streams(client, keys, "reader", "m", max_entry_bytes=1 << 20).published(job_id, 2, max_events)
        finally:
            await client.aclose()

    raw.set(keys.out("clobbered"), "not a stream")
    raw.hset(keys.job("clobbered"), "model:1", IDENTITY)
    assert asyncio.run(published("clobbered", 100)) is None
    pipe = raw.pipeline(transaction=False)
    for seq in range(RESUME_READ_PAGE + 10):
        pipe.xadd(keys.out("flooded"), encode_event(token(1, seq, [30], "x")))
    pipe.execute()
    assert asyncio.run(published("flooded", RESUME_READ_PAGE)) is None
    earlier, entries = asyncio.run(published("flooded", 4 * RESUME_READ_PAGE))
    assert earlier is None and len(entries) == RESUME_READ_PAGE + 10
