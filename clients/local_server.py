"""The local server: the embedded Valkey that `conveyor serve` runs for this user, as clients find it.

Its data folder is per user, never relative to where a command runs (so never inside a
checkout by default): `--data-dir`, else $CONVEYOR_DATA_DIR, else $XDG_DATA_HOME/conveyor,
else ~/.local/share/conveyor. actors/embedded_valkey.py keeps two files there that clients
read, and nothing else of it: `url` (where the server listens, rewritten when its port
changes) and `password` (0600). Clients with no URL of their own use it; their connections
re-read both files each time they connect (`LocalServerConnection`), so a client or a
gateway that outlives a restart of `conveyor serve` follows it, even to another port.

Those files decide where a client connects and which password it sends, so they are trusted
only when they are the user's own: the folder and each file must belong to this user
(st_uid == os.getuid()) and be neither group- nor world-writable, else UnsafeDataDir names
the path and what is wrong (another user could point clients at a server of theirs and
receive the password, or plant one). `conveyor serve` keeps the folder 0700 and the files
0600 (actors/embedded_valkey.py). Each file is checked on the descriptor it is read from.
This module never imports actors/.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import redis
import redis.asyncio.connection as async_connection
import redis.asyncio.retry as async_retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from conveyor.clients.errors import ConveyorError

DATA_DIR_ENV = "CONVEYOR_DATA_DIR"
PASSWORD_FILE = "password"
URL_FILE = "url"
# A restart of `conveyor serve` leaves its server down for a few seconds: commands retry a
# lost connection 18 times, 0.1 s apart doubling to 1 s: about 15 s in all, before they fail.
RIDE_OUT_RETRIES = 18
MAX_FILE_BYTES = 64 * 1024  # a URL or a password: a larger file is read only this far


class NoServerFound(ConveyorError):
    """No --redis-url, no $REDIS_URL and no local server recorded in the data folder."""


class UnsafeDataDir(ConveyorError):
    """The data folder, or its `url` or `password` file, is not this user's alone to write."""

    code = "unsafe_data_dir"


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """$CONVEYOR_DATA_DIR, else $XDG_DATA_HOME/conveyor, else ~/.local/share/conveyor."""
    env = os.environ if env is None else env
    if env.get(DATA_DIR_ENV):
        return Path(env[DATA_DIR_ENV]).expanduser()
    xdg = env.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "conveyor"


@dataclass(frozen=True)
class LocalServer:
    """What the data folder says: the server's URL (no password in it) and its password."""

    data_dir: Path
    url: str
    password: str | None


def find_local_server(data_dir: str | Path) -> LocalServer | None:
    """The server recorded in `data_dir`, or None when there is none (or it is not ours to
    read). UnsafeDataDir when the folder or a file it has is not the user's own."""
    directory = Path(data_dir)
    text = read_private(directory / URL_FILE)
    url = text.strip() if text is not None else ""
    if not url:
        return None
    return LocalServer(directory, url, read_password(directory / PASSWORD_FILE))


def read_password(path: Path) -> str | None:
    """The password in `path` without its trailing newline; None when missing or unreadable.
    UnsafeDataDir when it, or its folder, is not the user's own."""
    text = read_private(path)
    return (text.rstrip("\r\n") or None) if text is not None else None


def read_private(path: Path) -> str | None:
    """The text of a data-folder file: None when it (or the folder) is missing or unreadable,
    UnsafeDataDir when the folder or the file is not the user's own or the file is not a
    regular one. The file is checked on the descriptor it is read from (no swap in between)."""
    try:  # non-blocking: a FIFO planted there must not hang the client
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with open(descriptor, "rb") as file:
        try:
            folder = os.stat(path.parent)
        except OSError:
            return None
        check_private(path.parent, folder, "data folder")
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise UnsafeDataDir(f"refusing the local server's file {path}: it is not a regular file")
        check_private(path, status, "file")
        try:
            return file.read(MAX_FILE_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None


def check_private(path: Path, status: os.stat_result, what: str) -> None:
    """UnsafeDataDir unless `status` (of `path`) is this user's and not group- or world-writable."""
    if not hasattr(os, "getuid"):  # no owners to compare (Windows): the folder's ACLs decide
        return
    problems = []
    if status.st_uid != os.getuid():
        problems.append(f"owned by uid {status.st_uid}, not by this user (uid {os.getuid()})")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"writable by {_writers(status.st_mode)} (mode {stat.S_IMODE(status.st_mode):04o})")
    if problems:
        raise UnsafeDataDir(
            f"refusing the local server's {what} {path}: {' and '.join(problems)}. Another user could "
            f"point this client at a server of theirs (which would receive the password) or plant a "
            f"password. `conveyor serve` keeps the folder 0700 and its files 0600: fix the owner and mode "
            f"(chmod go-w), or use another --data-dir (or $CONVEYOR_DATA_DIR), or give --redis-url"
        )


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("its group", stat.S_IWGRP), ("everyone", stat.S_IWOTH)) if mode & bit)


def no_server_message(data_dir: Path) -> str:
    return (
        f"no Redis to connect to: no --redis-url, no $REDIS_URL, and no local server recorded in "
        f"{data_dir / URL_FILE}. Start one with `conveyor serve --model smollm2` (it records its URL and "
        f"password in {data_dir}), point at another data folder with --data-dir (or $CONVEYOR_DATA_DIR), "
        f"or give --redis-url (and --redis-password-file)"
    )


# ---------------------------------------------------------------- connections that follow it


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(url)
        return (parts.hostname, parts.port or 6379) if parts.hostname else None
    except ValueError:
        return None


class _Follows:
    """Before each (re)connect: the host, port and password the data folder records now."""

    data_dir: str

    def _follow(self) -> None:
        server = find_local_server(self.data_dir)
        where = _host_port(server.url) if server else None
        if where:
            self.host, self.port = where
            self.password = server.password


class LocalServerConnection(_Follows, redis.Connection):
    def __init__(self, *args: Any, data_dir: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_dir = data_dir

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_connected:
            self._follow()
        return super().connect_check_health(*args, **kwargs)


class AsyncLocalServerConnection(_Follows, async_connection.Connection):
    def __init__(self, *args: Any, data_dir: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_dir = data_dir

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_connected:
            self._follow()
        return await super().connect_check_health(*args, **kwargs)


def _not_auth(is_retryable: Any):
    """Refused credentials do not mend by retrying (AuthenticationError is a ConnectionError)."""
    return lambda error: not isinstance(error, AuthenticationError) and (is_retryable is None or is_retryable(error))


class RideOut(Retry):
    """Retry lost connections for about 15 s (RIDE_OUT_RETRIES), never refused credentials."""

    def __init__(self) -> None:
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), RIDE_OUT_RETRIES)

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return super().call_with_retry(do, fail, _not_auth(is_retryable), with_failure_count)


class AsyncRideOut(async_retry.Retry):
    def __init__(self) -> None:
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), RIDE_OUT_RETRIES)

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return await super().call_with_retry(do, fail, _not_auth(is_retryable), with_failure_count)


def following_options(data_dir: Path, asynchronous: bool) -> dict[str, Any]:
    """redis-py options of a client of the local server: follow its files, ride out restarts."""
    if asynchronous:
        return {"connection_class": AsyncLocalServerConnection, "data_dir": str(data_dir), "retry": AsyncRideOut()}
    return {"connection_class": LocalServerConnection, "data_dir": str(data_dir), "retry": RideOut()}
