"""Rank 0's side of tensor and pipeline parallelism: hosts the rendezvous, starts the other
ranks of this host (one ``python -m conveyor.engine.tp_worker`` process each: unlike
multiprocessing's spawn it never re-runs the caller's main script), waits for those of the
other hosts (``nnodes`` > 1: each started there by ``conveyor rank``), watches that they
live, and turns a dead or hung rank into one clear error."""

import contextlib
import json
import logging
import pickle
import subprocess
import time
import weakref

import torch

from conveyor.engine.child_env import module_command
from conveyor.engine.distributed.group import STORE_TIMEOUT_S, RankGroup, compute_timeout_s, host_store
from conveyor.engine.distributed.watchdog import StepWatchdog

log = logging.getLogger(__name__)
JOIN_POLL_S = 0.1
STOP_GRACE_S = 10.0
DEATH_NOTICE_S = 1.0  # after a failed collective, how long a dying rank may take to show as exited


class RankFailed(RuntimeError):
    """A tensor- or pipeline-parallel rank died or stopped answering: this engine cannot step any more."""


class Workers:
    """The ranks 1..world-1 of rank 0's group: the processes of those on this host, and the group itself."""

    def __init__(self, config, max_model_len: int, device: torch.device):
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        local = world // config.nnodes
        store = host_store(config.master_addr, config.master_port, world)
        store.set("config", remote_config(config, max_model_len))  # what ranks on other hosts build
        address = "127.0.0.1" if config.nnodes == 1 else config.master_addr
        self.processes = [_start_rank(config, rank, address, store.port, max_model_len) for rank in range(1, local)]
        for rank, process in enumerate(self.processes, start=1):
            log.info("parallel rank %d of %d: pid %d", rank, world, process.pid)
        if local < world:
            log.info(
                "waiting for ranks %d..%d from other hosts: conveyor rank --master-addr %s --master-port %d --rank R",
                local,
                world - 1,
                config.master_addr,
                store.port,
            )
        self._finalizer = weakref.finalize(self, _terminate, list(self.processes))
        self.failed = False  # a collective failed: the group cannot be used any more
        self.watchdog = StepWatchdog(self.processes, compute_timeout_s(), remote_ranks=local < world)
        try:
            self._wait_joined(store, world)
            self.group = RankGroup(store, 0, config.tensor_parallel_size, config.pipeline_parallel_size, device)
        except BaseException:
            self.watchdog.close()
            self._finalizer()
            raise

    def _wait_joined(self, store, world: int) -> None:
        """Until every rank reached the store (a rank of this host that fails to start ends
        the wait, and so does one of another host not there within the setup timeout)."""
        keys = [f"joined/{rank}" for rank in range(1, world)]
        deadline = time.monotonic() + STORE_TIMEOUT_S
        while not store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                missing = [rank for rank in range(1, world) if not store.check([f"joined/{rank}"])]
                raise RankFailed(f"parallel ranks {missing} did not join within {STORE_TIMEOUT_S} s")
            time.sleep(JOIN_POLL_S)

    def check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise RankFailed(f"parallel ranks: {dead}; this engine stops (its jobs go back to the queue)")

    def _dead(self) -> str:
        hung = " (killed: a step outlasted CONVEYOR_TP_TIMEOUT_S)" if self.watchdog.fired else ""
        return "; ".join(
            f"rank {rank} (pid {p.pid}) exited with code {p.returncode}{hung}"
            for rank, p in enumerate(self.processes, start=1)
            if p.poll() is not None
        )

    @contextlib.contextmanager
    def watch(self):
        """Around one step: a rank found dead, or a collective that failed or timed out
        (the watchdog kills ranks that hang), raises RankFailed naming the rank (the
        worker's own stderr says why it ended)."""
        self.check_alive()
        self.watchdog.start_step()
        try:
            with self.failures():
                yield
        finally:
            self.watchdog.end_step()

    @contextlib.contextmanager
    def failures(self):
        """A collective that failed (a rank died, here or on another host) as RankFailed."""
        try:
            yield
        except RuntimeError as exc:
            ends = time.monotonic() + DEATH_NOTICE_S
            while not self._dead() and time.monotonic() < ends:
                time.sleep(0.02)
            dead = self._dead()
            if dead or "gloo" in str(exc).lower() or "nccl" in str(exc).lower():
                self.failed = True
                raise RankFailed(
                    f"parallel ranks: {dead or 'a collective failed'} ({str(exc)[:300]}); "
                    f"this engine stops (its jobs go back to the queue)"
                ) from exc
            raise

    def close(self, link=None) -> None:
        """Ask the ranks to stop, then make sure they have; after a failure (a rank is dead,
        the others may wait on it for ever) end them at once."""
        self.watchdog.close()
        if not (self.failed or self._dead()):
            with contextlib.suppress(RuntimeError):
                self.group.send_step(None)
                if link is not None:
                    link.send_on(None)
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(STOP_GRACE_S)
        self._finalizer()


def remote_config(config, max_model_len: int) -> str:
    """The engine's options as JSON for ranks on other hosts (never pickle from a network)."""
    options = {name: value for name, value in vars(config).items() if name != "speculative_config"}
    spec = config.speculative_config
    options["speculative_config"] = None if spec is None else vars(spec)
    return json.dumps({"config": options, "max_model_len": max_model_len})


def _start_rank(config, rank: int, address: str, port: int, max_model_len: int) -> subprocess.Popen:
    """One rank's process; its arguments travel pickled on its stdin (trusted: our own child)."""
    process = subprocess.Popen(module_command("conveyor.engine.tp_worker"), stdin=subprocess.PIPE)
    arguments = dict(
        config=config,
        rank=rank,
        address=address,
        port=port,
        max_model_len=max_model_len,
        num_threads=torch.get_num_threads(),
    )  # as many as rank 0 uses: the ranks share the machine
    with process.stdin:
        process.stdin.write(pickle.dumps(arguments))
    return process


def _terminate(processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(STOP_GRACE_S)
