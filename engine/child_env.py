"""The engine's own child processes (the engine core process, tensor-parallel ranks): their
environment and how they meet signals."""

import os
import signal
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parent.parent)  # where ``engine`` is importable from


def child_env() -> dict:
    """This process's environment with this checkout first on PYTHONPATH, whatever the
    current directory (a git worktree that shares an editable install runs its own code)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}


def ignore_stop_signals() -> None:
    """A Ctrl-C (the whole process group) or a SIGTERM to every process of a container must
    not end the core or its tensor-parallel ranks under a front door that is still
    draining: the front door ends them (Shutdown, or its socket closing; the ranks follow
    rank 0). A Python handler, not SIG_IGN, which exec'd children would inherit."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)


def die_with_parent() -> None:
    """A parent killed with SIGKILL leaves no child computing for nobody (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
