"""actors/resilience.py's retry loop on its own: which errors mean "the connection is gone,
wait and retry" (a replica must survive them) and which are bugs that must surface."""

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from conveyor.actors import resilience


def run_with_failures(failures: list[BaseException]):
    """``retrying`` over an operation that raises each of ``failures`` in turn, then succeeds."""
    calls = []

    async def operation():
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return "done"

    return asyncio.run(resilience.retrying(operation, "test")), len(calls)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(resilience, "FIRST_BACKOFF_S", 0.001)


def test_lost_connections_and_torn_down_writers_are_retried():
    # the last two are what redis-py let through when a cluster master died mid-send (seen in
    # tests/test_redis_cluster.py: the second stopped a replica through its lease renewal)
    failures = [
        RedisConnectionError("Error 111 connecting"),
        OSError("reset"),
        RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed"),
        AttributeError("'NoneType' object has no attribute 'writelines'"),
    ]
    assert run_with_failures(failures) == ("done", 5)


@pytest.mark.parametrize(
    "bug",
    [
        AttributeError("'Delivery' object has no attribute 'size'"),
        RuntimeError("dictionary changed size during iteration"),
    ],
)
def test_other_errors_of_the_same_types_surface(bug):
    with pytest.raises(type(bug), match=str(bug)[:10]):
        run_with_failures([bug])
