"""Replica hardening (issue 39): a producer's `SET` on the partition-lease keys of a
namespace (the owners hash, the takers' sorted set) is repaired, never fatal: the claim
script replaces the wrong-typed key, the partition keeper logs it and claims again, and a
real replica keeps owning its partitions and running jobs. Real Valkey, real replicas."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from fault_harness import wait_until
from replica_harness import ReplicaThread, partition_steps

from conveyor.actors.partition_scripts import SCRIBBLED_MARK
from conveyor.clients import Client
from conveyor.clients.connection import RedisSettings
from conveyor.clients.keys import Keys

PARTITIONS = 4
LEASE_MS = 60_000


def run_steps(redis_url: str, keys: Keys, steps: list[tuple[str, str]]) -> list:
    return partition_steps(redis_url, keys, steps, LEASE_MS)


@pytest.mark.parametrize("which", ["owners", "takers"])
def test_a_wrong_typed_lease_key_is_replaced_by_the_claim_script(redis_url, namespace, raw, which):
    keys = Keys(namespace, partitions=PARTITIONS)
    key = keys.partition_owners if which == "owners" else keys.partition_takers
    (first,) = run_steps(redis_url, keys, [("a", "claim")])
    assert first == list(range(PARTITIONS))
    raw.set(key, "scribbled")
    released, repaired, claimed = run_steps(redis_url, keys, [("a", "release"), ("a", "claim"), ("a", "claim")])
    assert not isinstance(released, Exception)  # leaving never fails on a scribbled key
    assert isinstance(repaired, redis.ResponseError) and str(repaired).startswith(SCRIBBLED_MARK)
    assert f"{key} (not a {'hash' if which == 'owners' else 'zset'})" in str(repaired)
    assert claimed == list(range(PARTITIONS))  # on fresh keys
    assert raw.type(keys.partition_owners) == b"hash" and raw.type(keys.partition_takers) == b"zset"


@pytest.mark.parametrize("which", ["owners", "takers"])
def test_a_set_on_a_lease_key_does_not_stop_a_replica(tiny_model, redis_url, namespace, raw, caplog, which):
    """Before: WRONGTYPE crashed the partition keeper, and with it every replica of the
    namespace. Now: one warning, the replica owns its partitions again within a check or
    two, and jobs run."""
    keys = Keys(namespace, partitions=PARTITIONS)
    key = keys.partition_owners if which == "owners" else keys.partition_takers
    thread = ReplicaThread(tiny_model, redis_url, namespace, consumer="scribbled-on", lease_s=3.0)
    thread.config.redis = RedisSettings(url=redis_url, partitions=PARTITIONS)
    client = Client(connection=RedisSettings(url=redis_url, partitions=PARTITIONS), namespace=namespace)
    with caplog.at_level(logging.WARNING, logger="conveyor.actors.partitions"), thread:
        keeper = thread.replica.partitions
        wait_until(lambda: len(keeper.owned) == PARTITIONS, 10, "the replica to own every partition")
        raw.set(key, "not a " + ("hash" if which == "owners" else "sorted set"))
        wait_until(lambda: raw.type(key) != b"string", 10, "the keeper to replace the scribbled key")
        wait_until(
            lambda: raw.type(keys.partition_owners) == b"hash"
            and len(raw.hgetall(keys.partition_owners)) == PARTITIONS,
            10,
            "the replica's leases to be written again",
        )
        assert thread.replica.crash is None and len(keeper.owned) == PARTITIONS
        assert client.submit(prompt="hello", max_tokens=2).result(timeout=30).finish_reason == "length"
    client.close()
    assert thread.exit_code == 0
    warned = [r.getMessage() for r in caplog.records if "overwritten" in r.getMessage()]
    assert len(warned) == 1 and key in warned[0], warned


def test_the_repair_needs_no_command_the_documented_replica_acl_lacks(redis_url, namespace, raw):
    """The replica's ACL (docs/security.md) grants no TYPE: the scripts find a wrong type with
    a probe under pcall, and replace the key with DEL, which it grants."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    line = next(line for line in doc.splitlines() if line.startswith("ACL SETUSER conveyor-replica-tenant-a "))
    user = f"replica-{namespace}"
    rules = [rule.replace("tenant-a", namespace) for rule in line.split()[3:] if not rule.startswith(">")]
    raw.acl_setuser(user, reset=True)
    raw.execute_command("ACL", "SETUSER", user, *rules, ">acl-test-password")
    keys = Keys(namespace, partitions=PARTITIONS)
    as_replica = redis_url.replace("redis://", f"redis://{user}:acl-test-password@")
    try:
        raw.set(keys.partition_owners, "scribbled")
        raw.set(keys.partition_takers, "scribbled")
        raw.acl_log_reset()
        repaired, claimed, released = run_steps(as_replica, keys, [("a", "claim"), ("a", "claim"), ("a", "release")])
        assert isinstance(repaired, redis.ResponseError) and str(repaired).startswith(SCRIBBLED_MARK)
        assert claimed == list(range(PARTITIONS)) and not isinstance(released, Exception)
        assert [entry for entry in raw.acl_log() if entry.get("username") in (user, user.encode())] == []
    finally:
        raw.acl_deluser(user)
