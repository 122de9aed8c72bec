"""Partition ownership (actors/partitions.py) on the session's Valkey server, in the
partitioned layout: the ownership script's fair share as replicas join and leave, a
scribbled owners hash, an owner woken by the submit script (not by a probe), a job on a
partition another replica owns taken by probing (stealing), and real `conveyor serve`
processes: the partitions of one killed with SIGKILL move to the survivor within one lease."""

from __future__ import annotations

import time

import pytest
import redis
from fault_harness import spawner_fixture, start_all, wait_until
from replica_harness import ReplicaThread, partition_steps

from conveyor.clients import Client
from conveyor.clients.connection import RedisSettings
from conveyor.clients.keys import Keys

PARTITIONS = 4
LEASE_S = 1.5
LEASE_MS = 60_000  # the script tests' leases never lapse while they run


@pytest.fixture
def spawn(request, tmp_path, redis_url):
    yield from spawner_fixture(request, tmp_path, redis_url)


def owners(raw: redis.Redis, keys: Keys) -> dict[int, str]:
    """Partition -> consumer of the leases not yet expired (the server's clock)."""
    seconds, micros = raw.time()
    now_ms = seconds * 1000 + micros // 1000
    found = {}
    for field, value in raw.hgetall(keys.partition_owners).items():
        expiry, _, consumer = value.decode().partition(" ")
        if expiry.isdigit() and int(expiry) > now_ms:
            found[int(field)] = consumer
    return found


def claims(redis_url: str, keys: Keys, steps: list[tuple[str, str]], lease_ms: int = LEASE_MS) -> list[list[int]]:
    """The partitions each claim step returned (replica_harness.partition_steps)."""
    results = partition_steps(redis_url, keys, steps, lease_ms)
    assert not any(isinstance(r, Exception) for r in results), results
    return [result for (_, step), result in zip(steps, results) if step == "claim"]


def test_fair_share_as_replicas_join_and_leave(redis_url, namespace, raw):
    keys = Keys(namespace, partitions=PARTITIONS)
    alone, b_first, a_gives_back, b_takes, c_joins = claims(
        redis_url, keys, [("a", "claim"), ("b", "claim"), ("a", "claim"), ("b", "claim"), ("c", "claim")]
    )
    assert len(alone) == PARTITIONS and b_first == []  # nothing free until a gives back
    assert len(a_gives_back) == PARTITIONS // 2 and sorted(a_gives_back + b_takes) == list(range(PARTITIONS))
    assert c_joins == []  # ceil(4 / 3) = 2: a and b keep two each, c steals
    (b_after,) = claims(redis_url, keys, [("a", "release"), ("b", "claim")])
    (c_after,) = claims(redis_url, keys, [("c", "claim")])
    assert sorted(b_after + c_after) == list(range(PARTITIONS)) and b_after == b_takes
    assert set(owners(raw, keys).values()) == {"b", "c"}


def test_a_scribbled_owners_hash_frees_those_partitions(redis_url, namespace, raw):
    keys = Keys(namespace, partitions=PARTITIONS)
    far_future = (raw.time()[0] + 10 * 86_400) * 1000
    raw.hset(keys.partition_owners, mapping={"0": "not a lease", "1": f"{far_future} squatter", "2": b"\xff" * 64})
    raw.zadd(keys.partition_takers, {"squatter": far_future, "ghost-2": far_future})
    (taken,) = claims(redis_url, keys, [("a", "claim")])
    assert taken == list(range(PARTITIONS))  # the fake takers left the set, the fake leases are free
    assert raw.zrange(keys.partition_takers, 0, -1) == [b"a"]


def test_an_idle_owner_is_woken_by_the_submit_script(tiny_model, redis_url, namespace):
    """64 partitions, one replica owning all, probes made a minute apart: a job on a
    partition the probes are far from starts at once only because the submit script woke it."""
    partitions = 64
    thread = ReplicaThread(tiny_model, redis_url, namespace, consumer="woken")
    thread.config.redis = RedisSettings(url=redis_url, partitions=partitions)
    thread.config.read_block_ms, thread.config.idle_poll_max_s = 3_600_000, 60.0
    keys = Keys(namespace, partitions=partitions)
    client = Client(connection=RedisSettings(url=redis_url, partitions=partitions), namespace=namespace)
    with thread:
        ingest = thread.replica.ingest
        wait_until(lambda: len(thread.replica.partitions.owned) == partitions, 10, "the replica to own all")
        time.sleep(1.0)  # the first reads and the fast start of the probe ramp are over
        far = (ingest.next_probe + partitions // 2) % partitions
        job_id = next(f"wake-{n}" for n in range(10_000) if keys.partition_of(f"wake-{n}") == far)
        submitted = time.monotonic()
        job = client.submit(prompt="hello", max_tokens=2, job_id=job_id)
        assert job.result(timeout=30).finish_reason == "length"
        assert time.monotonic() - submitted < 10  # the next probe of that partition is minutes away
    client.close()


def test_a_job_on_a_partition_owned_elsewhere_is_stolen(tiny_model, redis_url, namespace):
    """Another consumer holds every partition's lease and reads nothing: the replica's
    probes (one partition at a time) still run the job."""
    keys = Keys(namespace, partitions=PARTITIONS)
    thread = ReplicaThread(tiny_model, redis_url, namespace, consumer="thief")
    # a lease as long as the replica's own (a longer one would count as scribbled: free)
    claims(redis_url, keys, [("absent-owner", "claim")], lease_ms=thread.config.partition_lease_ms)
    thread.config.redis = RedisSettings(url=redis_url, partitions=PARTITIONS)
    client = Client(connection=RedisSettings(url=redis_url, partitions=PARTITIONS), namespace=namespace)
    with thread:
        time.sleep(0.5)
        assert thread.replica.partitions.owned == frozenset()  # the other holds them all
        job = client.submit(prompt="hello", max_tokens=2)
        assert job.result(timeout=30).finish_reason == "length"
    client.close()


@pytest.mark.slow
def test_partitions_of_a_killed_replica_move_within_one_lease(spawn, tiny_model, redis_url, namespace, raw):
    keys = Keys(namespace, partitions=PARTITIONS)
    env = {"CONVEYOR_PARTITIONS": str(PARTITIONS)}
    pair = start_all([spawn(namespace, f"lease-{n}", tiny_model, lease_s=LEASE_S, env=env, keys=keys) for n in "ab"])
    wait_until(
        lambda: len(owners(raw, keys)) == PARTITIONS and set(owners(raw, keys).values()) == {r.consumer for r in pair},
        30,
        "both replicas to own their share",
    )
    shares = sorted(list(owners(raw, keys).values()).count(r.consumer) for r in pair)
    assert shares == [2, 2], owners(raw, keys)
    victim, survivor = pair
    assert victim.kill9() == -9
    killed = time.monotonic()
    every = {p: survivor.consumer for p in range(PARTITIONS)}
    wait_until(lambda: owners(raw, keys) == every, 10, "the survivor to own every partition", interval=0.02)
    moved_s = time.monotonic() - killed
    assert moved_s <= LEASE_S, f"partitions moved after {moved_s:.2f} s, lease {LEASE_S} s"
    assert survivor.alive()


def test_a_flood_of_junk_on_the_wake_channels_leaves_the_wake_up_working(tiny_model, redis_url, namespace, raw):
    """Wake channels are producer input: a producer may publish anything there. 5,000 junk
    messages, a 1 MB one and a channel nobody owns cost the owner coalesced wake-ups (a set
    of partitions, at most one read each per round); afterwards the submit script's wake-up
    still starts a job at once (probes are a minute apart, so nothing else could)."""
    partitions = 4
    thread = ReplicaThread(tiny_model, redis_url, namespace, consumer="flooded")
    thread.config.redis = RedisSettings(url=redis_url, partitions=partitions)
    thread.config.read_block_ms, thread.config.idle_poll_max_s = 3_600_000, 60.0
    keys = Keys(namespace, partitions=partitions)
    client = Client(connection=RedisSettings(url=redis_url, partitions=partitions), namespace=namespace)
    with thread:
        wait_until(lambda: len(thread.replica.partitions.owned) == partitions, 10, "the replica to own all")
        channels = [keys.requests(c, p) for c in ("interactive", "batch") for p in range(partitions)]
        pipe = raw.pipeline(transaction=False)
        for n in range(5_000):
            pipe.publish(channels[n % len(channels)], b"\xff junk %d" % n)
        pipe.publish(channels[0], b"x" * (1 << 20))
        pipe.publish(f"{namespace}:requests:interactive:nobody", b"wake")
        pipe.execute()
        time.sleep(1.0)  # the flood is taken in
        far = (thread.replica.ingest.next_probe + 2) % partitions
        job_id = next(f"after-{n}" for n in range(10_000) if keys.partition_of(f"after-{n}") == far)
        submitted = time.monotonic()
        assert client.submit(prompt="hello", max_tokens=2, job_id=job_id).result(timeout=30).finish_reason == "length"
        assert time.monotonic() - submitted < 10  # woken: the next probe is a minute away
    client.close()
