"""Rank 0's side of tensor parallelism: starts the other ranks (one ``python -m
engine.tp_worker`` process each: unlike multiprocessing's spawn it never re-runs
the caller's main script), watches that they live, and turns a dead or hung rank into one
clear error."""

import contextlib
import logging
import pickle
import subprocess
import time
import weakref

import torch

from conveyor.engine.child_env import module_command
from conveyor.engine.distributed.group import TPGroup, compute_timeout_s, host_store
from conveyor.engine.distributed.watchdog import StepWatchdog

log = logging.getLogger(__name__)
JOIN_POLL_S = 0.1
STOP_GRACE_S = 10.0
DEATH_NOTICE_S = 1.0  # after a failed collective, how long a dying rank may take to show as exited


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering: this engine cannot step any more."""


class Workers:
    """The ranks 1..size-1 of rank 0's group: their processes and the group itself."""

    def __init__(self, config, max_model_len: int, device: torch.device):
        size = config.tensor_parallel_size
        store = host_store(size)
        self.processes = [_start_rank(config, rank, store.port, max_model_len) for rank in range(1, size)]
        for rank, process in enumerate(self.processes, start=1):
            log.info("tensor-parallel rank %d of %d: pid %d", rank, size, process.pid)
        self._finalizer = weakref.finalize(self, _terminate, list(self.processes))
        self.watchdog = StepWatchdog(self.processes, compute_timeout_s())
        try:
            self._wait_joined(store)
            self.group = TPGroup(store, 0, size, device)
        except BaseException:
            self.watchdog.close()
            self._finalizer()
            raise

    def _wait_joined(self, store) -> None:
        """Until every rank reached the store (a rank that fails to start ends the wait)."""
        keys = [f"joined/{rank}" for rank in range(1, len(self.processes) + 1)]
        while not store.check(keys):
            self.check_alive()
            time.sleep(JOIN_POLL_S)

    def check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise RankFailed(f"tensor parallel: {dead}; this engine stops (its jobs go back to the queue)")

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
            yield
        except RuntimeError as exc:
            ends = time.monotonic() + DEATH_NOTICE_S
            while not self._dead() and time.monotonic() < ends:
                time.sleep(0.02)
            dead = self._dead()
            if dead or "gloo" in str(exc).lower() or "nccl" in str(exc).lower():
                raise RankFailed(
                    f"tensor parallel: {dead or 'a collective failed'} ({str(exc)[:300]}); "
                    f"this engine stops (its jobs go back to the queue)"
                ) from exc
            raise
        finally:
            self.watchdog.end_step()

    def close(self) -> None:
        """Ask the ranks to stop (when all still live), then make sure they have."""
        self.watchdog.close()
        if not self._dead():
            with contextlib.suppress(RuntimeError):
                self.group.send_step(None)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_GRACE_S)
        self._finalizer()


def _start_rank(config, rank: int, port: int, max_model_len: int) -> subprocess.Popen:
    """One rank's process; its arguments travel pickled on its stdin (trusted: our own child)."""
    process = subprocess.Popen(module_command("conveyor.engine.tp_worker"), stdin=subprocess.PIPE)
    arguments = dict(
        config=config, rank=rank, port=port, max_model_len=max_model_len, num_threads=torch.get_num_threads()
    )  # as many as rank 0 uses: the ranks share the machine
    with process.stdin:
        process.stdin.write(pickle.dumps(arguments))
    return process


def _terminate(processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(STOP_GRACE_S)
