"""The environment of the engine's own child processes (the engine core process, tensor-parallel ranks)."""
import os
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parent.parent)  # where ``engine`` is importable from


def child_env() -> dict:
    """This process's environment with this checkout first on PYTHONPATH, whatever the
    current directory (a git worktree that shares an editable install runs its own code)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}
