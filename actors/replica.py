"""One engine replica: wires the actors, watches for crashes and signals, shuts down
gracefully (finish in-flight jobs within the grace period, hand back the rest).

A replica may serve several namespaces (``conveyor serve --namespace a --namespace b``):
each gets a front door of its own (``Door``: its streams, ledger, intake, publisher, cancels,
model announcement and partition leases, so its keys, records and dead letters stay its
own), and all of them feed the one engine, whose admission shares it between them by token-
weighted fair share (engine/fair_share.py: each job's tenant is its namespace)."""

import asyncio
import logging
import signal
from pathlib import Path

from conveyor.actors import faults
from conveyor.actors.cancel_watcher import CancelWatcher
from conveyor.actors.config import ReplicaConfig
from conveyor.actors.engine_client import EngineCoreClient
from conveyor.actors.engine_core_actor import EngineCoreActor
from conveyor.actors.ingest import IngestActor
from conveyor.actors.ledger import JobLedger
from conveyor.actors.messages import Drain, HandBack
from conveyor.actors.metrics import ReplicaMetrics
from conveyor.actors.model_announcer import ModelAnnouncer
from conveyor.actors.partitions import PartitionKeeper
from conveyor.actors.publisher import PublisherActor
from conveyor.actors.resume import model_identity
from conveyor.actors.streams import Streams
from conveyor.actors.tracing import ChosenTraceIds, JobTracer, tracer_provider_from_env
from conveyor.clients.limits import MAX_JSON_BYTES, MAX_MSGPACK_BYTES

log = logging.getLogger(__name__)
# an entry larger than any valid payload is refused from a stub; it never leaves the server
MAX_ENTRY_BYTES = max(MAX_MSGPACK_BYTES, MAX_JSON_BYTES) + 4096


class Door:
    """One namespace's actors. ``name``: its key in the engine-core actor ("" on a replica
    serving one namespace, so request ids stay the job ids)."""

    def __init__(self, name: str, config: ReplicaConfig, engine: EngineCoreClient, replica: "Replica"):
        self.name, self.config = name, config
        facts = engine.facts
        # credentials and TLS: clients/connection.py
        self.streams = Streams(
            config.redis.async_client(),
            config.redis.keys(config.namespace),
            config.consumer,
            replica.model_name,
            max_entry_bytes=MAX_ENTRY_BYTES,
        )
        self.streams.model_identity = model_identity(replica.model_name, facts)  # a resumed job's check
        capacity = config.max_in_flight or 2 * facts.max_num_seqs
        self.ledger = JobLedger(self.streams, config, capacity)
        self.publisher = PublisherActor(self.streams, self.ledger, replica.metrics)
        replica.engine_core.publishers[name] = self.publisher
        self.ingest = IngestActor(self.streams, engine, self.ledger, replica.engine_core, self.publisher, config, name)
        self.ingest.metrics = replica.metrics
        self.ledger.connect(self.ingest, replica.engine_core)
        self.partitions = None
        if config.partition_ownership:
            self.partitions = PartitionKeeper(
                self.streams, config.partition_lease_ms, config.partition_check_s, self.ingest.wake
            )
            self.ingest.partitions = self.ledger.partitions = self.partitions
        self.cancels = CancelWatcher(self.streams, self.ledger)
        if replica.tracer_provider is not None:
            tracer = JobTracer(replica.tracer_provider, config.namespace, replica.model_name, config.consumer)
            self.ingest.tracer = self.publisher.tracer = tracer
        self.announcer = ModelAnnouncer(
            self.streams,
            facts,
            engine.tokenizer,
            replica.model_name,
            config.max_queue_len,
            config.max_tokens_cap,
            tuple(config.lora_modules),
            replica.metrics,
            config.token_budget,
        )
        if config.token_budget:
            self.ingest.budget = self.announcer.budget

    def actors(self) -> tuple:
        """Downstream first, so each actor's consumers exist before it sends to them."""
        keeper = (self.partitions,) if self.partitions is not None else ()
        return (self.publisher, self.ledger, self.cancels, self.announcer, *keeper, self.ingest)

    async def stop_intake(self) -> None:
        self.announcer.state = "draining"
        await self.ingest.stop()
        if self.partitions is not None:
            await self.partitions.stop()
            await self.partitions.release()  # others take its partitions at their next check


class Replica:
    def __init__(self, engine: EngineCoreClient, config: ReplicaConfig):
        """``engine``: the front door's end of the engine core, started in a process of its
        own or on a thread (actors/engine_client.py); nothing here knows which."""
        assert config.redis_url, "a replica needs a Redis URL"
        self.engine = engine
        self.config = config
        self.model_name = config.served_model_name or Path(engine.facts.model_name).name
        self.metrics = ReplicaMetrics()
        self.engine_core = EngineCoreActor(engine, {}, self.metrics, faults.job_hooks())
        self.tracer_provider = tracer_provider_from_env("conveyor-replica", ChosenTraceIds)  # None: no tracing
        namespaces = config.namespaces
        self.doors = [
            Door(
                ns if len(namespaces) > 1 else "",
                config.for_namespace(ns),
                engine,
                self,
            )
            for ns in namespaces
        ]
        first = self.doors[0]  # the names a replica of one namespace has always had
        self.streams, self.ledger, self.publisher, self.ingest = (
            first.streams,
            first.ledger,
            first.publisher,
            first.ingest,
        )
        self.partitions, self.cancels, self.announcer = first.partitions, first.cancels, first.announcer
        self.stop_requested = asyncio.Event()
        self.crash: BaseException | None = None

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or ``request_stop``); 0 on a clean stop, 1 on a crash."""
        for door in self.doors:
            await door.streams.resilient(door.streams.ensure_groups, "create consumer groups")
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        self._install_signal_handlers()
        for actor in self._actors():
            actor.start(self._on_crash)
        log.info(
            "replica %s serving model %r in namespace%s %s on %s",
            self.config.consumer,
            self.model_name,
            "s" if len(self.doors) > 1 else "",
            ", ".join(repr(d.config.namespace) for d in self.doors),
            self.config.redis.describe(),
        )
        await self.stop_requested.wait()
        if self.crash is None:
            await self._drain()
        await self._stop_actors()
        for door in self.doors:
            if self.crash is None:
                await door.announcer.farewell()
            await door.streams.close()
        if self.tracer_provider is not None:  # the last spans exported (bounded by the exporter's timeout)
            await asyncio.to_thread(self.tracer_provider.shutdown)
        return 1 if self.crash else 0

    def request_stop(self) -> None:
        self.stop_requested.set()

    def _on_crash(self, name: str, exc: BaseException) -> None:
        log.critical("actor %s crashed; stopping the replica", name, exc_info=exc)
        self.crash = exc
        self.stop_requested.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass

    async def _drain(self) -> None:
        """Stop taking work; let in-flight jobs finish within the grace period; hand back
        the rest only once no step can publish them any more (no result after hand-back)."""
        for door in self.doors:
            await door.stop_intake()
        drained = [asyncio.ensure_future(door.ledger.ask(Drain())) for door in self.doors]
        await asyncio.wait(drained, timeout=self.config.grace_s)  # entries in intake can't progress now
        for future in drained:
            future.cancel()
        # always: entries read but never recorded may be pending even when nothing is held
        await self.engine_core.stop()
        for door in self.doors:
            await door.publisher.mailbox.join()  # outputs of finished steps still get published
        for door in self.doors:
            await door.ledger.ask(HandBack())  # after the releases those outputs sent it

    def _actors(self):
        """Downstream first: publishers, then the engine-core actor, then the rest of each door."""
        publishers = tuple(door.publisher for door in self.doors)
        rest = tuple(actor for door in self.doors for actor in door.actors()[1:])
        return (*publishers, self.engine_core, *rest)

    async def _stop_actors(self) -> None:
        for actor in reversed(self._actors()):
            await actor.stop()
