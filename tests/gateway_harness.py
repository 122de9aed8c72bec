"""A real OpenAI-compatible gateway for tests, on a free loopback port.

- `GatewayProcess`: `conveyor gateway ...` in a subprocess (the real command line, its
  log file, SIGTERM/kill), ready once `/health` answers.
- `GatewayThread`: the same app under uvicorn in a thread of the test process: starts in
  well under a second, takes extra routers (e.g. the Batch API's) and any GatewaySettings.
- `openai_client` / `async_openai_client`: the official SDK pointed at a gateway, with
  retries off (the SDK retries 429 and 5xx by default: tests want the first answer).

Both gateways speak to the Redis at `redis_url`; API keys are given as {key: "namespace" or
"namespace:batch"} (the CONVEYOR_GATEWAY_API_KEYS form) or as a keys file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]

CONVEYOR = REPO_ROOT / ".venv" / "bin" / "conveyor"
# `conveyor gateway` (the installed command) and the same subcommand through the light client
# CLI, which loads no engine code at all (the `conveyor` entry point builds `serve`'s options)
CONVEYOR_GATEWAY = (str(CONVEYOR), "gateway")
LIGHT_GATEWAY = (sys.executable, "-m", "conveyor.gateway")
READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def key_list(keys: dict[str, str] | None) -> str | None:
    """{key: "ns[:class]"} -> the CONVEYOR_GATEWAY_API_KEYS text."""
    return ",".join(f"{key}={target}" for key, target in keys.items()) if keys else None


class _Gateway:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What the OpenAI SDK takes as base_url."""
        return f"{self.url}/v1"

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


class GatewayThread(_Gateway):
    """uvicorn + create_app in a daemon thread; `settings` are GatewaySettings fields."""

    def __init__(
        self,
        redis_url: str,
        namespace: str | None = None,
        *,
        keys: dict[str, str] | None = None,
        keys_file: str | Path | None = None,
        extra_routers: Iterable[Any] = (),
        connection: Any = None,
        **settings: Any,
    ) -> None:
        from conveyor.clients.connection import resolve_settings
        from conveyor.gateway.server import make_server
        from conveyor.gateway.settings import GatewaySettings

        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))  # bound before start: no race for the port
        self.port = self._socket.getsockname()[1]
        options = {"namespace": namespace} if namespace else {}
        redis = connection or resolve_settings(redis_url)  # connection: a RedisSettings (e.g. cluster=True)
        self.settings = GatewaySettings(
            redis=redis,
            host="127.0.0.1",
            port=self.port,
            api_keys=key_list(keys),
            keys_file=str(keys_file) if keys_file else None,
            log_level="warning",
            **options,
            **settings,
        )
        self.server = make_server(self.settings, extra_routers)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name=f"gateway-{self.port}", daemon=True
        )

    def start(self) -> GatewayThread:
        self._thread.start()
        ends = time.monotonic() + READY_TIMEOUT_S
        while not self.server.started:
            assert self._thread.is_alive(), "the gateway thread exited during startup"
            assert time.monotonic() < ends, "the gateway did not start"
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()
        assert not self._thread.is_alive(), "the gateway did not stop"


class GatewayProcess(_Gateway):
    """`conveyor gateway` in its own process (and process group), logging to a file."""

    def __init__(
        self,
        redis_url: str,
        log_dir: Path,
        namespace: str | None = None,
        *,
        keys: dict[str, str] | None = None,
        keys_file: str | Path | None = None,
        args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        name: str = "gateway",
        entry: Iterable[str] = CONVEYOR_GATEWAY,
    ) -> None:
        self.port = free_port()
        self.log_path = Path(log_dir) / f"{name}.log"
        flags = ["--redis-url", redis_url, "--host", "127.0.0.1", "--port", str(self.port)]
        flags += ["--namespace", namespace] if namespace else []
        flags += ["--keys-file", str(keys_file)] if keys_file else []
        self.command = [*entry, *flags, "--log-level", "warning", *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop("REDIS_URL", None)
        if keys:
            self.env["CONVEYOR_GATEWAY_API_KEYS"] = key_list(keys)
        self.process: subprocess.Popen | None = None

    def start(self) -> GatewayProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO_ROOT, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> GatewayProcess:
        ends = time.monotonic() + timeout
        while not self.healthy():
            if self.process.poll() is not None:
                raise AssertionError(f"gateway exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
            if time.monotonic() > ends:
                raise AssertionError(f"gateway not healthy after {timeout:.0f}s:\n{self.log_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def __enter__(self):
        return self.start().wait_ready()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful: uvicorn closes streams, their jobs get cancelled), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def openai_client(gateway: _Gateway, api_key: str = "unused", **options: Any):
    import openai

    return openai.OpenAI(
        base_url=gateway.base_url, api_key=api_key, max_retries=0, timeout=options.pop("timeout", 120), **options
    )


def async_openai_client(gateway: _Gateway, api_key: str = "unused", **options: Any):
    import openai

    return openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key=api_key, max_retries=0, timeout=options.pop("timeout", 120), **options
    )
