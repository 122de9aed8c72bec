"""What the benchmark scripts share: a model's vocabulary size, summary statistics,
readable tables, JSON output, and a replica spawned in a subprocess (embedded Valkey +
``conveyor serve``), as in production.

The scripts import it as a sibling module (``from harness import ...``), the way
queue_vs_offline.py imports offline.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Token ids drawn like offline.make_workload's (skipping the first 100 special ids)."""
    return [rng.randrange(100, vocab) for _ in range(length)]


def vocab_size(model: str) -> int:
    from engine.models.loader import load_spec
    return load_spec(model).hf_config.vocab_size


def summarize(values: Sequence[float], percentiles: Sequence[int] = (50, 99)) -> dict:
    """mean, median and the given percentiles (numpy's linear interpolation, as vLLM)."""
    if not len(values):
        return {"mean": None, **{f"p{p}": None for p in percentiles}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in percentiles}}


def format_table(rows: list[dict], columns: Sequence[str]) -> str:
    """Fixed-width text table; floats get 4 significant digits, None is '-'."""
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_json(path: str | None, data: dict) -> None:
    """Strict JSON (infinite rates become the string "inf", NaN becomes null)."""
    if path:
        Path(path).write_text(json.dumps(_strict(data), indent=2, default=str, allow_nan=False))
        print(f"wrote {path}")


def _strict(value):
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def add_json_option(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON here")


# ---- a replica in a subprocess ---------------------------------------------------------------
@contextlib.contextmanager
def embedded_valkey() -> Iterator[str]:
    """A throwaway Valkey server (no AOF); yields its URL."""
    from actors.embedded_valkey import EmbeddedValkey
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as data_dir:
        with EmbeddedValkey(data_dir, appendonly=False, password=None) as server:
            yield server.url


@contextlib.contextmanager
def spawned_replica(model: str, redis_url: str, engine_args: str | Sequence[str] = (),
                    log_path: str | None = None) -> Iterator[subprocess.Popen]:
    """``conveyor serve`` on ``redis_url`` with extra engine flags; SIGTERM (then SIGKILL) on exit.

    Its output (warnings only) goes to ``log_path``, else to ours. Does not wait for the
    model to load: submit a warm-up job and wait for its result."""
    flags = shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)
    conveyor = Path(sys.executable).with_name("conveyor")
    command = [str(conveyor), "serve", "--model", model, "--redis-url", redis_url, *flags]
    with open(log_path, "ab") if log_path else contextlib.nullcontext() as log:
        replica = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log else None,
                                   env={**os.environ, "CONVEYOR_LOG_LEVEL": "WARNING"})
        try:
            yield replica
        finally:
            _stop(replica)


def _stop(process: subprocess.Popen, timeout: float = 60.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def check_alive(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is not None:
        raise RuntimeError(f"the replica exited with code {process.returncode} (see its log)")

