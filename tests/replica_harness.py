"""Runs a real replica (engine core on a thread + actors) on its own event loop in a background thread."""

import asyncio
import threading

import redis
import redis.asyncio as aioredis

from conveyor.actors.config import ReplicaConfig
from conveyor.actors.engine_client import EngineCoreClient
from conveyor.actors.replica import Replica
from conveyor.actors.streams import Streams
from conveyor.engine import EngineConfig, LLMEngine


class ReplicaThread:
    def __init__(
        self,
        model: str,
        redis_url: str,
        namespace: str,
        consumer: str = "replica-a",
        lease_s: float = 30.0,
        served_model_name: str | None = None,
        more_namespaces: tuple[str, ...] = (),
        **engine_options,
    ):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.config = ReplicaConfig(
            redis_url=redis_url,
            namespace=namespace,
            more_namespaces=more_namespaces,
            consumer=consumer,
            lease_s=lease_s,
            grace_s=10.0,
            read_block_ms=100,
            served_model_name=served_model_name,
        )
        self.loop = asyncio.new_event_loop()
        self.replica: Replica | None = None
        self.exit_code: int | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=consumer, daemon=True)

    def start(self) -> "ReplicaThread":
        self._thread.start()
        assert self._ready.wait(30), "replica did not start"
        return self

    def stop(self, timeout: float = 30.0) -> int:
        self.loop.call_soon_threadsafe(self.replica.request_stop)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "replica did not stop"
        return self.exit_code

    def call(self, coroutine, timeout: float = 30.0):
        """Run a coroutine on the replica's loop (to look at its state from a test)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        core = EngineCoreClient.on_thread(self.engine)  # the production core loop, on a thread
        self.replica = Replica(core, self.config)
        self.loop.call_soon(self._ready.set)
        self.exit_code = self.loop.run_until_complete(self.replica.run())
        self.loop.run_until_complete(core.aclose())
        self.loop.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()


def run_producers(produce, count: int, timeout: float) -> None:
    """``produce(index)`` for ``count`` producers on their own threads at once; fails with
    every producer's exception (a thread's exception would otherwise be lost)."""
    errors: list[Exception] = []

    def guarded(index: int) -> None:
        try:
            produce(index)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads), f"a producer still runs after {timeout} s"


def partition_steps(redis_url: str, keys, steps: list[tuple[str, str]], lease_ms: int = 60_000) -> list:
    """Run (consumer, 'claim' | 'release') steps in order, each through its own Streams: what
    each returned (a claim: its partitions, sorted), or the ResponseError it raised."""

    async def main():
        client = aioredis.Redis.from_url(redis_url)
        results = []
        try:
            for consumer, step in steps:
                streams = Streams(client, keys, consumer, "m", max_entry_bytes=1 << 20)
                try:
                    if step == "claim":
                        results.append(sorted(await streams.claim_partitions(lease_ms)))
                    else:
                        results.append(await streams.release_partitions())
                except redis.ResponseError as exc:
                    results.append(exc)
        finally:
            await client.aclose()
        return results

    return asyncio.run(main())
