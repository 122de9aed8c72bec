"""Rank 0's guard against a rank that hangs (alive, sockets open, answering nothing: a
frozen VM, SIGSTOP, a deadlock): a step in flight longer than the timeout gets the other
ranks killed, which closes their sockets, so rank 0's waiting collective fails at once.
gloo's own timeout is not enough: measured here, a 3 s all-reduce timeout raised after
~300 s (its error path waited on the rendezvous store) or never fired at all."""

import logging
import threading
import time

log = logging.getLogger(__name__)
POLL_S = 0.25


class StepWatchdog:
    def __init__(self, processes: list, timeout_s: float):
        self.processes, self.timeout_s = processes, timeout_s
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
                    "tensor parallel: a step has run %.0f s (CONVEYOR_TP_TIMEOUT_S=%g): killing the other "
                    "ranks, which do not answer",
                    time.monotonic() - started,
                    self.timeout_s,
                )
                self.fired = True
                for process in self.processes:
                    process.kill()
                return
