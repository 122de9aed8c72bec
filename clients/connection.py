"""How Conveyor connects to Redis: credentials, TLS, and the one place redis-py clients are built.

Options (a flag of `conveyor serve|submit|status|dead|summarize`, its environment variable):

    --redis-url URL            $REDIS_URL, else the local server (below). `rediss://` is TLS.
                               May carry `user:password@` (prefer the options below: a URL
                               on a command line is visible in `ps`).
    --redis-username NAME      $REDIS_USERNAME (an ACL user; default: the URL's, else `default`)
    --redis-password-file PATH $REDIS_PASSWORD_FILE; the file's content, trailing newline stripped
    (no flag)                  $REDIS_PASSWORD (no password flag: argv is visible in `ps`)
    --redis-ca-cert PATH       $REDIS_CA_CERT: verify the server's certificate against this CA
                               (without it, the system's CAs); needs a rediss:// URL
    --redis-cert / --redis-key $REDIS_CERT / $REDIS_KEY: client certificate for mutual TLS
    --data-dir DIR             $CONVEYOR_DATA_DIR, else $XDG_DATA_HOME/conveyor, else
                               ~/.local/share/conveyor: the local server's folder, see below
    --redis-cluster            $REDIS_CLUSTER=1: the URL is one node of a Redis/Valkey Cluster;
                               connect with redis-py's cluster clients and use the hash-tagged
                               key layout (clients/keys.py, docs/protocol.md "Key layouts")
    --partitions N             $CONVEYOR_PARTITIONS: request stream partitions per class (default
                               1 on a single server, 4 in cluster mode); every producer and
                               replica of a namespace must use the same number

Which server: --redis-url (or `Client(url)`), else $REDIS_URL (what `conveyor serve` itself
would use), else the local server: the embedded Valkey that `conveyor serve` started for
this user, recorded in the data folder (clients/local_server.py); its connections follow
that folder's files across restarts. Nothing found is an error naming the ways out
(NoServerFound). The choice is logged once per process.

Password precedence, highest first: an explicit value (a flag, or a keyword of
`resolve_settings`), then the password file, then the environment, then the URL's own
`user:password@`. Only when none of them gives a password: the embedded Valkey's password
file in the data folder (`<data_dir>/password`), used when `<data_dir>/url` names the same
host and port as the URL -- so the URL that `conveyor serve` prints works as it is (the
files are 0600: only that user can read them). The folder and both files are used only when
they are the user's own and not group- or world-writable; otherwise UnsafeDataDir names the
path and what is wrong (clients/local_server.py).

`redact(url)` is what every log line and print of a URL goes through: secrets never reach
a log or stdout. This module never imports torch, engine/ or actors/.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
import redis.cluster as sync_cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from conveyor.clients.errors import ConveyorError
from conveyor.clients.keys import DEFAULT_REDIS_URL, Keys, partitions_setting
from conveyor.clients.local_server import (
    PASSWORD_FILE,
    URL_FILE,
    NoServerFound,
    UnsafeDataDir,  # noqa: F401 - raised by the discovery below, importable from here
    default_data_dir,
    find_local_server,
    following_options,
    no_server_message,
)

log = logging.getLogger("conveyor.connection")

DEFAULT_DATA_DIR = "$XDG_DATA_HOME/conveyor or ~/.local/share/conveyor"  # for help texts
NO_RETRY = Retry(NoBackoff(), 0)
GIVEN = "as given"
MASK = "***"
SCHEMES = ("redis", "rediss", "unix")
# An asyncio process (replica, gateway, batch runner) may have hundreds of commands in the
# air at once, and a sync Client may be shared by as many threads. redis-py 8's pools hold
# 100 connections and raise "Too many connections" past that; the clients built here wait
# for a free connection instead (up to POOL_WAIT_S): a BlockingConnectionPool for a single
# server, sync or async, and for each node of a sync cluster client. (redis-py's async
# cluster client has no waiting pool: it gets ASYNC_POOL_SIZE per node and raises past it.)
ASYNC_POOL_SIZE = 256
SYNC_POOL_SIZE = 128  # per client (per node in a cluster): threads past it wait their turn
POOL_WAIT_S = 30.0


class ServerUnavailable(ConveyorError):
    """The local server does not answer, or refused the credentials (a one-shot command's check)."""


@dataclass(frozen=True)
class RedisSettings:
    """Where and how to connect. `url` never carries credentials (they live in the fields),
    and neither repr nor str shows the password."""

    url: str = DEFAULT_REDIS_URL
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    cluster: bool = False  # `url` is a node of a cluster: redis-py's cluster clients
    partitions: int | None = None  # request stream partitions (None: the mode's default)
    # the local server's data folder when the URL came from it: connections re-read its files
    local_dir: str | None = None

    def __post_init__(self) -> None:
        bare_url, user, password = split_credentials(self.url)
        if bare_url != self.url:  # RedisSettings(url="redis://user:pw@...") directly: move them out
            object.__setattr__(self, "url", bare_url)
            object.__setattr__(self, "username", self.username or user)
            object.__setattr__(self, "password", self.password or password)
        _check_tls(self)

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    def client(self, **options: Any) -> redis.Redis | sync_cluster.RedisCluster:
        """A synchronous redis-py client (bytes responses unless `options` say otherwise), safe
        to share between threads: past SYNC_POOL_SIZE commands at once, a thread waits for a
        free connection (up to POOL_WAIT_S) rather than failing."""
        kwargs = {**self._connection_kwargs(), **self._following(False), **options}
        waiting = {"max_connections": SYNC_POOL_SIZE, "timeout": POOL_WAIT_S}
        if self.cluster:
            pools = {"connection_pool_class": redis.BlockingConnectionPool, **waiting}
            return sync_cluster.RedisCluster.from_url(self.url, **{**pools, **kwargs})
        single = kwargs.pop("single_connection_client", False)
        pool = redis.BlockingConnectionPool.from_url(self.url, **{**waiting, **kwargs})
        client = redis.Redis(connection_pool=pool, single_connection_client=single)
        client.auto_close_connection_pool = True  # as Redis.from_url: close() closes the pool
        return client

    def async_client(self, **options: Any) -> aioredis.Redis | async_cluster.RedisCluster:
        """An asyncio redis-py client whose pool waits for a free connection rather than
        failing a command under load (a cluster client: a larger per-node pool)."""
        kwargs = {**self._connection_kwargs(), **self._following(True), **options}
        if self.cluster:
            return async_cluster.RedisCluster.from_url(self.url, **{"max_connections": ASYNC_POOL_SIZE, **kwargs})
        pool_options = {"max_connections": ASYNC_POOL_SIZE, "timeout": POOL_WAIT_S, **kwargs}
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(self.url, **pool_options))

    def _following(self, asynchronous: bool) -> dict[str, Any]:
        return following_options(Path(self.local_dir), asynchronous) if self.local_dir else {}

    def keys(self, namespace: str | None = None) -> Keys:
        """The key layout of `namespace` on this server (cluster mode: hash-tagged, partitioned)."""
        return Keys.of(namespace, cluster=self.cluster, partitions=self.partitions)

    def describe(self) -> str:
        """One line for logs: the URL, the user, TLS; never the password."""
        who = f" as {self.username}" if self.username else ""
        auth = ", password set" if self.password else ""
        tls = f", TLS (CA {self.ca_cert or 'system'}{', client cert' if self.cert else ''})" if self.tls else ""
        cluster = ", cluster" if self.cluster else ""
        local = f" (the local server of {self.local_dir})" if self.local_dir else ""
        return f"{redact(self.url)}{who}{auth}{tls}{cluster}{local}"

    def __str__(self) -> str:
        return self.describe()

    def _connection_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls:
            kwargs.update(
                ssl_cert_reqs="required", ssl_ca_certs=self.ca_cert, ssl_certfile=self.cert, ssl_keyfile=self.key
            )
        return kwargs


def _check_tls(settings: RedisSettings) -> None:
    if (settings.ca_cert or settings.cert or settings.key) and not settings.tls:
        raise ValueError(
            f"--redis-ca-cert/--redis-cert/--redis-key need a rediss:// URL (TLS), got {redact(settings.url)}"
        )
    if bool(settings.cert) != bool(settings.key):
        raise ValueError("--redis-cert and --redis-key go together (client certificate and its key)")


def resolve_settings(
    url: str | None = None,
    *,
    username: str | None = None,
    password: str | None = None,
    password_file: str | Path | None = None,
    ca_cert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    data_dir: str | Path | None = None,
    cluster: bool | None = None,
    partitions: int | None = None,
    env: Mapping[str, str] | None = None,
) -> RedisSettings:
    """Apply the choices of the module docstring: the server (URL, $REDIS_URL, the local
    server of `data_dir`, default the user's data folder), then its password (explicit >
    file > environment > URL > the local server's password file)."""
    env = os.environ if env is None else env
    folder = Path(data_dir) if data_dir else default_data_dir(env)
    chosen_url, source, local = choose_server(url, folder, env)
    bare_url, url_user, url_password = split_credentials(chosen_url)
    password_file = password_file or env.get("REDIS_PASSWORD_FILE")
    chosen_password = _first(
        password, read_password_file(password_file) if password_file else None, env.get("REDIS_PASSWORD"), url_password
    )
    if chosen_password is None:
        chosen_password = embedded_password(folder, bare_url)
    if source != GIVEN:  # a URL that was not given: say where it came from
        _say_once(f"Redis: {redact(bare_url)}, {source}")
    return RedisSettings(
        url=bare_url,
        username=_first(username, env.get("REDIS_USERNAME"), url_user),
        password=chosen_password,
        ca_cert=_first(ca_cert, env.get("REDIS_CA_CERT")),
        cert=_first(cert, env.get("REDIS_CERT")),
        key=_first(key, env.get("REDIS_KEY")),
        cluster=cluster if cluster is not None else _truthy(env.get("REDIS_CLUSTER")),
        partitions=partitions or partitions_setting(env.get("CONVEYOR_PARTITIONS")),
        local_dir=str(folder) if local else None,
    )


def choose_server(url: str | None, data_dir: Path, env: Mapping[str, str]) -> tuple[str, str, bool]:
    """(the URL to use, where it came from, whether that is the local server): `url`, else
    $REDIS_URL, else the local server recorded in `data_dir`."""
    if url:
        return url, GIVEN, False
    if env.get("REDIS_URL"):
        return env["REDIS_URL"], "from $REDIS_URL", False
    server = find_local_server(data_dir)
    if server is None:
        raise NoServerFound(no_server_message(data_dir))
    return server.url, f"the local server (conveyor serve's, recorded in {data_dir / URL_FILE})", True


_said: set[str] = set()


def _say_once(line: str) -> None:
    """Log which server a process chose, once per choice (clients are made often)."""
    if line not in _said:
        _said.add(line)
        log.info("%s", line)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def client_settings(redis_url: str | None, connection: RedisSettings | None) -> RedisSettings:
    """What Client(redis_url, connection=...) connects with: the settings, else the URL
    resolved with the environment (REDIS_PASSWORD, ...)."""
    if connection is None:
        return resolve_settings(redis_url)
    if redis_url is not None:
        raise ValueError("give redis_url or connection (which has its own url), not both")
    return connection


def _first(*values: str | None) -> str | None:
    return next((v for v in values if v), None)


def read_password_file(path: str | Path) -> str:
    """The password in `path`: its content without the trailing newline (as `echo` leaves it)."""
    text = Path(path).read_text(encoding="utf-8")
    password = text.rstrip("\r\n")
    if not password:
        raise ValueError(f"password file {path} is empty")
    return password


# ---------------------------------------------------------------- URLs


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(url without `user:password@`, username, password), percent-decoded."""
    parts = _split(url)
    if "@" not in parts.netloc:
        return url, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    bare = urlunsplit(parts._replace(netloc=hostport))
    return bare, unquote(user) or None, unquote(password) if password else None


def redact(url: str) -> str:
    """`url` with any password (userinfo or `?password=`) replaced by ***; safe to log."""
    try:
        parts = urlsplit(str(url))
    except ValueError:
        return re.sub(r"//[^/@]*@", f"//{MASK}@", str(url))
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{hostport}"
    if "password" in query:
        query = urlencode([(k, MASK if k == "password" else v) for k, v in parse_qsl(query)], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _split(url: str):
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {redact(url)!r}")
    return parts


def same_server(url_a: str, url_b: str) -> bool:
    """Same scheme, host and port (localhost and 127.0.0.1 count as one)."""

    def where(url: str):
        parts = _split(split_credentials(url)[0])
        host = "127.0.0.1" if parts.hostname in ("localhost", "::1") else parts.hostname
        return parts.scheme, host, parts.port or 6379

    try:
        return where(url_a) == where(url_b)
    except ValueError:
        return False


# ---------------------------------------------------------------- the embedded server's files


def embedded_password(data_dir: str | Path, url: str) -> str | None:
    """The embedded Valkey's password when `data_dir` holds one for the server at `url`."""
    server = find_local_server(data_dir)  # None: no embedded server there; UnsafeDataDir: not the user's own
    return server.password if server and same_server(server.url, url) else None


# ---------------------------------------------------------------- command-line options


def add_connection_arguments(parser: argparse.ArgumentParser, *, data_dir: bool = True) -> None:
    """The credential and TLS flags (not --redis-url, whose default differs per command).
    Their defaults are None: resolve_settings applies the environment, in order."""
    parser.add_argument("--redis-username", default=None, help="ACL user (env REDIS_USERNAME)")
    parser.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help="file holding the password (env REDIS_PASSWORD_FILE; or env REDIS_PASSWORD)",
    )
    parser.add_argument(
        "--redis-ca-cert",
        default=None,
        metavar="PATH",
        help="CA that signed the server's TLS certificate; needs rediss:// (env REDIS_CA_CERT)",
    )
    parser.add_argument(
        "--redis-cert", default=None, metavar="PATH", help="client certificate for mutual TLS (env REDIS_CERT)"
    )
    parser.add_argument(
        "--redis-key", default=None, metavar="PATH", help="client certificate's private key (env REDIS_KEY)"
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="the URL is a node of a Redis/Valkey Cluster (env REDIS_CLUSTER=1)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="request stream partitions per class, the same for every producer and replica "
        "(default 1, 4 with --redis-cluster; env CONVEYOR_PARTITIONS)",
    )
    if data_dir:
        parser.add_argument(
            "--data-dir",
            default=None,
            help="the local server's folder (conveyor serve's embedded Valkey): its URL is used "
            "without --redis-url, its password for its URL "
            f"(env CONVEYOR_DATA_DIR, default {DEFAULT_DATA_DIR})",
        )


def settings_from_args(args: argparse.Namespace, url: str | None = None) -> RedisSettings:
    """RedisSettings from the flags of add_connection_arguments (+ --redis-url, --data-dir)."""
    return resolve_settings(
        url or getattr(args, "redis_url", None),
        username=args.redis_username,
        password_file=args.redis_password_file,
        ca_cert=args.redis_ca_cert,
        cert=args.redis_cert,
        key=args.redis_key,
        data_dir=getattr(args, "data_dir", None),
        cluster=getattr(args, "redis_cluster", None),
        partitions=getattr(args, "partitions", None),
    )


def command_settings(args: argparse.Namespace) -> RedisSettings:
    """settings_from_args for a one-shot command (submit, status, batch...): a local server
    that does not answer or refuses the credentials fails at once, naming the ways out."""
    settings = settings_from_args(args)
    problem = check_credentials(settings, wait_for_server=False) if settings.local_dir else None
    if problem:
        raise ServerUnavailable(problem)
    return settings


def check_credentials(settings: RedisSettings, wait_for_server: bool = True) -> str | None:
    """One PING: a message when the server refuses the credentials or its certificate
    fails verification, else None.

    Only those are judged here: they will not mend by waiting, while an unreachable
    server may come up later (the replica and the gateway retry), and an ACL user without
    PING is fine. `wait_for_server=False` (one-shot commands): a local server that does
    not answer is reported too (its recorded URL outlived it)."""
    client = None
    try:
        # one try (no riding out here: this asks whether it answers now); a cluster client connects here
        client = settings.client(socket_connect_timeout=5, socket_timeout=5, retry=NO_RETRY)
        client.ping()
    except redis.AuthenticationError as exc:
        return refused_message(settings, exc)
    except redis.ConnectionError as exc:
        if isinstance(_root_cause(exc), ssl.SSLCertVerificationError):
            return f"TLS certificate of Redis at {settings.describe()} failed verification: {_root_cause(exc)}"
        if settings.local_dir and not wait_for_server:
            return (
                f"the local server at {redact(settings.url)} (recorded in {Path(settings.local_dir) / URL_FILE}) "
                f"does not answer ({exc}): start `conveyor serve`, or give --redis-url or --data-dir"
            )
        return None
    except (redis.RedisError, sync_cluster.RedisClusterException):  # e.g. no cluster node reachable yet
        return None
    finally:
        if client is not None:
            client.close()
    return None


def refused_message(settings: RedisSettings, exc: BaseException) -> str:
    """Credentials refused: what was tried, and every way to give the right ones."""
    given = "a password" if settings.password else "no password"
    folder = settings.local_dir or str(default_data_dir())
    return (
        f"Redis at {settings.describe()} refused the credentials ({given} sent: {exc}). For the local server "
        f"started by `conveyor serve`, its password is in {Path(folder) / PASSWORD_FILE} (another folder: "
        f"--data-dir); for another server give --redis-url with --redis-password-file, $REDIS_PASSWORD or "
        f"--redis-username"
    )


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ or exc.__context__:
        exc = exc.__cause__ or exc.__context__
    return exc
