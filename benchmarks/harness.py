"""What the benchmark scripts share: a model's vocabulary size, summary statistics,
readable tables, JSON output, this machine's CPU in one line, a replica spawned in a
subprocess (embedded Valkey + ``conveyor serve``) as in production, a ``conveyor gateway``
spawned next to it, and the CPU seconds a process tree has used.

The scripts import it as a sibling module (``from harness import ...``), the way
queue_vs_offline.py imports offline.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Token ids drawn like offline.make_workload's (skipping the first 100 special ids)."""
    return [rng.randrange(100, vocab) for _ in range(length)]


def vocab_size(model: str) -> int:
    from conveyor.engine.models.loader import load_spec

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


def write_json(path: str | None, data: dict, quiet: bool = False) -> None:
    """Strict JSON (infinite rates become the string "inf", NaN becomes null)."""
    if path:
        Path(path).write_text(json.dumps(_strict(data), indent=2, default=str, allow_nan=False))
        if not quiet:
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


# ---- this machine ----------------------------------------------------------------------------
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its feature flags, from /proc/cpuinfo (first CPU)."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    return model, flags


def isa_flags() -> dict[str, bool]:
    """Which of the vector / matrix extensions that pick a CPU path this CPU reports
    (avx2, avx512f, avx512_vnni, avx512_bf16, amx_tile, amx_bf16, amx_int8)."""
    flags = cpu_flags()[1]
    return {name: name in flags for name in ISA_FLAGS}


def cpu_info() -> dict:
    """The CPU's model name, logical CPUs (and those this process may use), the widest
    vector ISA it reports, and the kernels torch dispatches to (imported only if already
    loaded or installed)."""
    model, flags = cpu_flags()
    isa = next((name for name in ("avx512f", "avx2", "avx", "sse4_2", "asimd", "neon") if name in flags), None)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch_isa = None
    with contextlib.suppress(Exception):
        import torch

        torch_isa = torch.backends.cpu.get_cpu_capability()
    return {
        "model": model,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "isa": "avx512" if isa == "avx512f" else isa,
        "torch_isa": torch_isa,
        "avx512_vnni": "avx512_vnni" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_tile" in flags,
    }


def describe_cpu(info: dict | None = None) -> str:
    """One line, e.g. ``CPU: AMD EPYC, 2 CPUs (2 usable), ISA avx2 (torch kernels: AVX2)``."""
    info = info or cpu_info()
    extras = [name for name in ("avx512_vnni", "avx512_bf16", "amx") if info.get(name)]
    return (
        f"CPU: {info['model']}, {info['logical_cpus']} CPUs ({info['usable_cpus']} usable), "
        f"ISA {info['isa'] or 'unknown'}{''.join(' + ' + e for e in extras)}"
        f" (torch kernels: {info['torch_isa'] or '-'})"
    )


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its live descendants (Linux /proc;
    None elsewhere or once it is gone)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    if pid not in stats:
        return None
    tree, total, frontier = {pid}, 0, [pid]
    while frontier:
        parent = frontier.pop()
        total += stats[parent][1]
        children = [child for child, (ppid, _) in stats.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier += children
    return total / ticks


# ---- a replica in a subprocess ---------------------------------------------------------------
@contextlib.contextmanager
def embedded_valkey() -> Iterator[str]:
    """A throwaway Valkey server (no AOF); yields its URL."""
    from conveyor.actors.embedded_valkey import EmbeddedValkey

    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as data_dir:
        with EmbeddedValkey(data_dir, appendonly=False, password=None) as server:
            yield server.url


@contextlib.contextmanager
def spawned_replica(
    model: str,
    redis_url: str,
    engine_args: str | Sequence[str] = (),
    log_path: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """``conveyor serve`` on ``redis_url`` with extra engine flags; SIGTERM (then SIGKILL) on exit.

    Its output (warnings only) goes to ``log_path``, else to ours. Does not wait for the
    model to load: submit a warm-up job and wait for its result."""
    flags = shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)
    conveyor = Path(sys.executable).with_name("conveyor")
    command = [str(conveyor), "serve", "--model", model, "--redis-url", redis_url, *flags]
    with open(log_path, "ab") if log_path else contextlib.nullcontext() as log:
        replica = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            env={
                **os.environ,
                "CONVEYOR_LOG_LEVEL": os.environ.get("CONVEYOR_BENCH_LOG_LEVEL", "WARNING"),
                **(env or {}),
            },
        )
        try:
            yield replica
        finally:
            _stop(replica)


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    """An OTLP/HTTP endpoint that accepts every export and keeps nothing (what tracing costs
    the replica, not a collector): its base URL, for OTEL_EXPORTER_OTLP_ENDPOINT."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def spawned_gateway(
    redis_url: str,
    namespace: str | None = None,
    log_path: str | None = None,
    args: Sequence[str] = (),
    ready_timeout: float = 60.0,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``conveyor gateway`` on a free loopback port against ``redis_url``, without API keys
    (one namespace: ``namespace`` or the default); yields (its URL, the process) once
    ``/health`` answers. SIGTERM (then SIGKILL) on exit."""
    port = free_port()
    conveyor = Path(sys.executable).with_name("conveyor")
    command = [
        str(conveyor),
        "gateway",
        "--redis-url",
        redis_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *(["--namespace", namespace] if namespace else []),
        *args,
    ]
    env = {**os.environ, "CONVEYOR_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    for name in (
        "REDIS_URL",
        "CONVEYOR_GATEWAY_API_KEYS",
        "CONVEYOR_GATEWAY_KEYS_FILE",
        "CONVEYOR_GATEWAY_PORT",
        "CONVEYOR_GATEWAY_HOST",
    ):
        env.pop(name, None)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") if log_path else contextlib.nullcontext() as log:
        gateway = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log else None, env=env)
        try:
            _wait_healthy(url, gateway, ready_timeout)
            yield url, gateway
        finally:
            _stop(gateway, timeout=20)


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {process.returncode} (see its log)")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} was not healthy after {timeout:.0f} s")
        time.sleep(0.1)


def _stop(process: subprocess.Popen, timeout: float = 60.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def check_alive(process: subprocess.Popen | None, what: str = "replica") -> None:
    if process is not None and process.poll() is not None:
        raise RuntimeError(f"the {what} exited with code {process.returncode} (see its log)")
