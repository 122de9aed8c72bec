"""The client core without Redis: programs are fed replies by hand."""

from __future__ import annotations

import pytest

from conveyor.clients import client_core as core
from conveyor.clients.errors import JobFailed, Timeout
from conveyor.clients.events import DoneEvent, ErrorEvent, TokenEvent
from conveyor.clients.keys import Keys
from conveyor.clients.protocol import encode_event


class FakeClient:
    keys = Keys("core-test")


def entries(*events) -> list:
    return [[b"out", [(f"1-{i}".encode(), encode_event(e)) for i, e in enumerate(events)]]]


def run(program, replies):
    """Drive `program` with `replies` in order; the steps it asked for, what it emitted, its result."""
    steps, emitted, replies = [], [], iter(replies)
    stepper = core.Run(program)
    for step in stepper:
        if isinstance(step, core.Emit):
            emitted.append(step.value)
        else:
            steps.append(step)
            stepper.reply(next(replies))
    return steps, emitted, stepper.result


def test_submit_asks_for_the_submit_script_and_builds_the_handle():
    steps, _, handle = run(
        core.submit(
            FakeClient.keys, {"prompt": "hi", "job_id": "j1"}, None, lambda job_id, enqueued: (job_id, enqueued)
        ),
        [1],
    )
    assert [(s.name, s.keys[0]) for s in steps] == [("submit", "core-test:job:j1")]
    assert handle == ("j1", True)


def test_stream_emits_tokens_keeps_the_terminal_and_raises_for_an_error():
    job = core.JobState(FakeClient(), "j2")
    error = ErrorEvent(attempt=1, seq=1, code="boom", message="no")
    with pytest.raises(JobFailed):
        run(core.stream(job, "0-0", None), [entries(TokenEvent(attempt=1, seq=0, text="a"), error)])
    assert (job._terminal.code, job._terminal.entry_id) == ("boom", "1-1")


def test_result_reads_the_hash_then_the_stream_and_a_failing_call_raises_in_the_program():
    job = core.JobState(FakeClient(), "j3")
    done = DoneEvent(attempt=1, seq=0, finish_reason="stop", text="ok")
    steps, _, result = run(core.result(job, timeout=5), [{}, None, entries(done)])
    assert [s.method for s in steps] == ["hgetall", "xread", "xread"] and result.text == "ok"
    stepper = core.Run(core.result(core.JobState(FakeClient(), "j4"), timeout=0.0))
    next(stepper)
    stepper.reply({})
    next(stepper)
    stepper.reply(None)  # nothing within the timeout
    with pytest.raises(Timeout):
        next(stepper)
    stepper = core.Run(core.status(core.JobState(FakeClient(), "j5")))
    next(stepper)
    stepper.fail(ConnectionError("down"))
    with pytest.raises(ConnectionError):
        next(stepper)
