"""The engine's own child processes (the engine core process, tensor-parallel ranks): how
they are started and how they meet signals."""

import signal
import sys


def module_command(module: str) -> list[str]:
    """``python -m module`` in this interpreter, importing Conveyor as this process does (from
    where it is installed), without the current directory on sys.path (-P, Python 3.11+): a
    folder named like a dependency (``kernels``, which transformers imports, or a checkout's
    top-level folders) where serve was started must not shadow it in the child."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", module]


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
