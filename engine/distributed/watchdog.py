"""Rank 0's guard against a rank that hangs (alive, sockets open, answering nothing: a
frozen VM, SIGSTOP, a deadlock): a step in flight longer than the timeout gets the other
ranks killed, which closes their sockets, so rank 0's waiting collective fails at once.
gloo's own timeout is not enough: measured here, a 3 s all-reduce timeout raised after
~300 s (its error path waited on the rendezvous store) or never fired at all. Ranks on other
hosts cannot be killed from here: with any, rank 0's process exits instead (the replica's
jobs go back to the queue, as when a rank dies)."""

import logging
import os
import threading
import time

log = logging.getLogger(__name__)
POLL_S = 0.25


class StepWatchdog:
    def __init__(self, processes: list, timeout_s: float, remote_ranks: bool = False):
        self.processes, self.timeout_s, self.remote_ranks = processes, timeout_s, remote_ranks
        self.step_started: float | None = None  # monotonic time the step in flight began
        self.fired = False
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="conveyor-tp-watchdog", daemon=True).start()

    def start_step(self) -> None:
        self.step_started = time.monotonic()

    def end_step(self) -> None:
        self.step_started = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            started = self.step_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                log.error(
                    "parallel ranks: a step has run %.0f s (CONVEYOR_TP_TIMEOUT_S=%g): killing the other "
                    "ranks, which do not answer%s",
                    time.monotonic() - started,
                    self.timeout_s,
                    " (some are on other hosts: this process exits)" if self.remote_ranks else "",
                )
                self.fired = True
                for process in self.processes:
                    process.kill()
                if self.remote_ranks:
                    os._exit(1)
                return
