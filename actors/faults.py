"""Fault injection for the reliability suite, off unless CONVEYOR_FAULT_INJECTION=1.

A job whose metadata has ``"conveyor_fault": "crash"`` kills the replica that starts running
it (as a crashing kernel would), so tests can watch poison jobs get retried and parked."""

import logging
import os

log = logging.getLogger(__name__)
CRASH_EXIT_CODE = 70


def enabled() -> bool:
    return os.environ.get("CONVEYOR_FAULT_INJECTION") == "1"


def job_hooks() -> tuple:
    """What the engine-core actor runs on each new job's metadata: nothing unless injection is on,
    so production never pays for (or trips on) the seam."""
    return (crash_if_poisoned,) if enabled() else ()


def crash_if_poisoned(metadata: dict) -> None:
    if metadata.get("conveyor_fault") == "crash":
        log.critical("fault injection: crashing on a poison job")
        logging.shutdown()
        os._exit(CRASH_EXIT_CODE)
