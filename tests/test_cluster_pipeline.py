"""Streams.write when a node fails part of a pipelined step (issue 39 item 16): on a real
Valkey cluster (tests/cluster_harness.py, 3 masters, loopback), one node is made to refuse
the commands of its slots while the others answer, and every command of the step must
land exactly once after it recovers: none lost, none sent twice. A command's own error
(WRONGTYPE) is still returned in the replies, not retried.

How the partial failures are made, each deterministic:
- CLUSTERDOWN: one master drops a slot none of the step's keys use (CLUSTER DELSLOTS); it
  then sees a slot uncovered and answers "CLUSTERDOWN The cluster is down" to every command,
  while the other masters still serve theirs. CLUSTER ADDSLOTS gives it back.
- a slot on the move: its master is set MIGRATING to another node that is not IMPORTING it;
  a command on a key not there yet is sent back and forth (ASK, MOVED) until the cluster
  client gives up ("TTL exhausted"), a script with some of its keys there gets TRYAGAIN.
  CLUSTER SETSLOT ... STABLE ends it.
- a dead master: kill -9 (no replica). A client already connected to it gets "Connection
  closed" as its commands' replies; one that never was cannot connect, and its pipeline
  raises after the other masters answered. Restarted on its port and data, it serves again.
And on a single server, a consumer group lost (NOGROUP) under a pipeline whose other
commands went through: the groups are recreated and only the failed commands sent again
(their script reloaded, the server having forgotten it).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
from cluster_harness import ValkeyCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ResponseError

from conveyor.actors.embedded_valkey import EmbeddedValkey
from conveyor.actors.messages import Delivery
from conveyor.actors.resilience import transient
from conveyor.actors.streams import Streams
from conveyor.clients.keys import GROUP, Keys
from conveyor.clients.redis_cluster import queue_script

PARTITIONS = 6  # over 3 masters: each master serves some of the step's slots
TOKENS = 3  # token events per job in the step
RECOVERY_S = 20.0  # how long a write may take once the node is back


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ValkeyCluster(tmp_path_factory.mktemp("pipeline_cluster"), masters=3, with_replicas=False) as running:
        yield running


@functools.cache
def admin_of(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def admin(node) -> redis.Redis:
    """A plain client on one node (for CLUSTER commands)."""
    return admin_of(node.url)


def wait_state(node, state: str, timeout: float = 60.0) -> None:  # a deadline, not a speed claim
    ends = time.monotonic() + timeout
    while f"cluster_state:{state}".encode() not in admin(node).execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < ends, f"node {node.port} never reached cluster_state:{state}"
        time.sleep(0.02)


class Step:
    """One step as the publisher writes it: every job's token events, then its finish."""

    def __init__(self, streams: Streams, keys: Keys, job_ids: list[str], model: str | None = None):
        self.streams, self.keys, self.job_ids = streams, keys, job_ids
        self.deliveries = [
            Delivery(keys.job_request_stream(job_id, "interactive", model), "1-1", job_id, result_ttl=600)
            for job_id in job_ids
        ]
        self.at: dict[str, list[int]] = {}  # job id -> pipeline index of each of its commands

    def expected(self, job_id: str) -> list[tuple[bytes, bytes]]:
        tokens = [(b"token", f"{job_id}:{seq}".encode()) for seq in range(TOKENS)]
        return [*tokens, (b"done", f"{job_id}:done".encode())]

    async def queue(self, pipe) -> None:
        self.at = {job_id: [] for job_id in self.job_ids}
        for seq in range(TOKENS):
            for delivery in self.deliveries:
                self.at[delivery.job_id] += [len(pipe), len(pipe) + 1]
                event = {"type": b"token", "data": f"{delivery.job_id}:{seq}".encode()}
                self.streams.queue_token_event(pipe, delivery, event)
        for delivery in self.deliveries:
            self.at[delivery.job_id].append(len(pipe))
            event = {"type": b"done", "data": f"{delivery.job_id}:done".encode()}
            await self.streams.queue_finish(pipe, delivery, "done", event)

    async def events(self, client, job_id: str) -> list[tuple[bytes, bytes]]:
        rows = await client.xrange(self.keys.out(job_id))
        return [(fields[b"type"], fields[b"data"]) for _id, fields in rows]

    async def assert_landed_once(self, client, job_ids: list[str], ordered: bool = True) -> None:
        for job_id in job_ids:
            events = await self.events(client, job_id)
            if ordered:
                assert events == self.expected(job_id), job_id
            else:
                assert sorted(events) == sorted(self.expected(job_id)), job_id
            assert await client.hget(self.keys.job(job_id), "status") == b"done", job_id


def job_ids_by_master(cluster: ValkeyCluster, keys: Keys, prefix: str) -> dict[int, list[str]]:
    """One job per partition, by the port of the master that serves its slot."""
    chosen: dict[int, str] = {}
    index = 0
    while len(chosen) < keys.partitions:
        job_id = f"{prefix}-{index}"
        chosen.setdefault(keys.partition_of(job_id), job_id)
        index += 1
    by_master: dict[int, list[str]] = {}
    for job_id in chosen.values():
        by_master.setdefault(cluster.master_of(keys.out(job_id)).port, []).append(job_id)
    assert len(by_master) >= 2, "the step's slots must span several masters"
    return by_master


def node_of(cluster: ValkeyCluster, port: int):
    return next(node for node in cluster.masters if node.port == port)


async def cluster_streams(cluster: ValkeyCluster, **options) -> tuple[Streams, Keys, async_cluster.RedisCluster]:
    keys = Keys.of(f"cp{uuid.uuid4().hex[:8]}", cluster=True, partitions=PARTITIONS)
    client = async_cluster.RedisCluster.from_url(cluster.url, **options)
    streams = Streams(client, keys, "consumer-1", "m", max_entry_bytes=1 << 20)
    await streams.ensure_groups()
    return streams, keys, client


def pending_failures(replies: list) -> list:
    return [reply for reply in replies if isinstance(reply, BaseException) and transient(reply)]


def test_a_step_a_node_answers_clusterdown_to_lands_every_command_once_after_it_recovers(cluster):
    async def scenario():
        streams, keys, client = await cluster_streams(cluster)
        by_master = job_ids_by_master(cluster, keys, "down")
        down_port = max(by_master, key=lambda port: len(by_master[port]))
        down = node_of(cluster, down_port)
        healthy = [job_id for port, ids in by_master.items() if port != down_port for job_id in ids]
        clobbered, healthy = healthy[0], healthy[1:]  # a producer made its out stream a string
        await client.set(keys.out(clobbered), "not a stream")
        all_jobs = [job_id for ids in by_master.values() for job_id in ids]
        step = Step(streams, keys, all_jobs)

        used = {key_slot(keys.out(job_id).encode()) for job_id in all_jobs}
        spare = next(
            first
            for first, _last, (_host, port, *_), *_ in admin(down).execute_command("CLUSTER", "SLOTS")
            if int(port) == down_port and first not in used
        )
        admin(down).execute_command("CLUSTER", "DELSLOTS", spare)
        try:
            wait_state(down, "fail")
            write = asyncio.create_task(streams.write(step.queue, "test step"))
            await asyncio.sleep(1.5)
            if write.done():
                replies = write.result()
                pytest.fail(f"the write returned while a node answered CLUSTERDOWN: {pending_failures(replies)}")
            # meanwhile the jobs on the other masters were written, once
            await step.assert_landed_once(client, healthy)
        finally:
            admin(down).execute_command("CLUSTER", "ADDSLOTS", spare)
        cluster.wait_ok()
        replies = await asyncio.wait_for(write, RECOVERY_S)

        assert pending_failures(replies) == []
        await step.assert_landed_once(client, [job_id for job_id in all_jobs if job_id != clobbered])
        # the clobbered job's own errors came back once, as they are (its EXPIREs went through)
        own = [replies[index] for index in step.at[clobbered]]
        assert [isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply) for reply in own] == [
            True,
            False,
        ] * TOKENS + [True]
        assert await client.type(keys.out(clobbered)) == b"string"
        await client.aclose()

    asyncio.run(scenario())


def test_a_command_s_own_error_is_returned_at_once_not_retried(cluster):
    async def scenario():
        streams, keys, client = await cluster_streams(cluster)
        job_ids = [job_id for ids in job_ids_by_master(cluster, keys, "own").values() for job_id in ids]
        await client.hset(keys.out(job_ids[0]), "clobbered", "1")  # WRONGTYPE for XADD
        step = Step(streams, keys, job_ids)
        replies = await asyncio.wait_for(streams.write(step.queue, "test step"), 5.0)  # retried: never returns

        own = step.at[job_ids[0]]
        failed = {index for index, reply in enumerate(replies) if isinstance(reply, BaseException)}
        assert failed == {*own[0:-1:2], own[-1]}  # its XADDs and its finish script, nothing else
        assert all(isinstance(replies[index], ResponseError) and "WRONGTYPE" in str(replies[index]) for index in failed)
        await step.assert_landed_once(client, job_ids[1:])
        await client.aclose()

    asyncio.run(scenario())


def test_a_slot_on_the_move_has_its_commands_sent_again_until_it_settles(cluster):
    """Exactly once, not necessarily in order: redis-py's cluster pipeline follows each
    redirected command on its own after the others (ASK, TRYAGAIN), so when the slot settles
    in the middle of that, a later command of the slot can go through before an earlier one."""

    async def scenario():
        streams, keys, client = await cluster_streams(cluster)
        by_master = job_ids_by_master(cluster, keys, "moving")
        source_port = next(iter(by_master))
        moving_job = by_master[source_port][0]
        source = node_of(cluster, source_port)
        target = next(node for node in cluster.masters if node.port != source_port)
        all_jobs = [job_id for ids in by_master.values() for job_id in ids]
        step = Step(streams, keys, all_jobs, model="absent")  # no key of the moving job exists yet
        slot = key_slot(keys.out(moving_job).encode())
        target_id = admin(target).cluster("myid").decode()

        # migrating to a node that does not import it: ASK there, MOVED back, again and again
        admin(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        try:
            write = asyncio.create_task(streams.write(step.queue, "test step"))
            await asyncio.sleep(1.5)
            if write.done():
                replies = write.result()
                pytest.fail(f"the write returned while a slot was on the move: {pending_failures(replies)}")
            others = [job_id for job_id in all_jobs if key_slot(keys.out(job_id).encode()) != slot]
            await step.assert_landed_once(client, others)
        finally:
            admin(source).execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        replies = await asyncio.wait_for(write, RECOVERY_S)

        assert not [reply for reply in replies if isinstance(reply, BaseException)]
        await step.assert_landed_once(client, others)
        await step.assert_landed_once(client, [moving_job], ordered=False)
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("connected", [True, False], ids=["replies-fail", "pipeline-raises"])
def test_a_dead_master_s_commands_are_sent_again_once_it_is_back_and_only_they(cluster, connected):
    """kill -9 of a master (no replica). A client connected to it before gets "Connection
    closed" as the replies of its commands; a client that never was cannot connect and its
    pipeline raises once redis-py's own retries (made short here) are spent, after the other
    masters answered. Either way, once the master is back only its commands are sent again."""

    async def scenario():
        streams, keys, client = await cluster_streams(cluster)
        by_master = job_ids_by_master(cluster, keys, "dead")
        dead_port = max(by_master, key=lambda port: len(by_master[port]))
        dead = node_of(cluster, dead_port)
        all_jobs = [job_id for ids in by_master.values() for job_id in ids]

        dead.kill()
        try:
            if not connected:
                fresh = async_cluster.RedisCluster.from_url(cluster.url, retry=Retry(NoBackoff(), 1))
                streams = Streams(fresh, keys, "consumer-1", "m", max_entry_bytes=1 << 20)
            step = Step(streams, keys, all_jobs)
            write = asyncio.create_task(streams.write(step.queue, "test step"))
            await asyncio.sleep(1.5)
            if write.done():
                pytest.fail(f"the write returned while a master was dead: {pending_failures(write.result())}")
        finally:
            dead.start()
        cluster.wait_ok()
        replies = await asyncio.wait_for(write, RECOVERY_S)

        assert not [reply for reply in replies if isinstance(reply, BaseException)]
        await step.assert_landed_once(client, all_jobs)
        await client.aclose()
        if not connected:
            await streams.close()

    asyncio.run(scenario())


def test_a_lost_group_on_one_server_sends_only_the_failed_commands_again(tmp_path):
    """Single server, plain pipeline: an XCLAIM and a script fail with NOGROUP (the group was
    lost) while a dead letter's XADD and a finish script go through: the groups are recreated
    and only the two that failed are sent again (the script reloaded: the server forgot it)."""

    async def scenario(url: str):
        keys = Keys("single")
        client = aioredis.Redis.from_url(url)
        streams = Streams(client, keys, "consumer-1", "m", max_entry_bytes=1 << 20)
        await streams.ensure_groups()
        stream = keys.interactive
        entry = (await client.xadd(stream, {"job": "x"})).decode()
        await client.xreadgroup(GROUP, "consumer-1", {stream: ">"})
        await client.xgroup_destroy(stream, GROUP)
        pending_script = client.register_script("return redis.call('XPENDING', KEYS[1], ARGV[1])")

        recreate, recreated = streams.ensure_groups, []

        async def forget_scripts_then_recreate():
            await client.script_flush()
            recreated.append(True)
            await recreate()

        streams.ensure_groups = forget_scripts_then_recreate
        delivery = Delivery(stream, entry, "job-1", result_ttl=600)

        async def queue(pipe):
            streams.queue_dead_letter(pipe, stream, entry, "test", {"job": "x"}, job_id="job-2")  # 4 commands
            pipe.xclaim(stream, GROUP, "consumer-1", 0, [entry], justid=True)  # NOGROUP
            await queue_script(pending_script, [stream], [GROUP], pipe)  # NOGROUP, in a script
            await streams.queue_finish(pipe, delivery, "done", {"type": b"done", "data": b"finished"})

        replies = await asyncio.wait_for(streams.write(queue, "test step"), RECOVERY_S)

        assert recreated == [True]
        assert not [reply for reply in replies if isinstance(reply, BaseException)]
        assert replies[4] == [] and replies[5][0] == 0  # claimed nothing, nothing pending: the group is new
        assert await client.xlen(keys.dead) == 1  # sent once, not again with the failed ones
        assert [fields[b"type"] for _id, fields in await client.xrange(keys.out("job-1"))] == [b"done"]
        assert await client.hget(keys.job("job-1"), "status") == b"done"
        await client.aclose()

    with EmbeddedValkey(tmp_path / "valkey", password=None) as server:
        asyncio.run(scenario(server.url))
