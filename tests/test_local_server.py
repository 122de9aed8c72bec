"""The local server as clients find it (clients/local_server.py, clients/connection.py) and
as the embedded Valkey records it (actors/embedded_valkey.py): real valkey-server
processes in temporary data folders, real redis-py clients; no model."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest
import redis

from conveyor.actors.embedded_valkey import EmbeddedValkey, EmbeddedValkeyError
from conveyor.clients import AsyncClient, Client
from conveyor.clients.connection import NoServerFound, resolve_settings
from conveyor.clients.local_server import default_data_dir


@pytest.fixture
def home(tmp_path, monkeypatch):
    """This process as a user's shell whose data home is a temporary folder."""
    for name in ("REDIS_URL", "REDIS_PASSWORD", "REDIS_PASSWORD_FILE", "REDIS_USERNAME", "CONVEYOR_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "conveyor"


@pytest.fixture
def server(home):
    made = EmbeddedValkey(home).start()
    yield made
    made.stop()


def test_the_data_folder_is_per_user_and_never_the_current_folder(tmp_path):
    assert default_data_dir({"XDG_DATA_HOME": "/data/me"}) == Path("/data/me/conveyor")
    assert default_data_dir({}) == Path.home() / ".local" / "share" / "conveyor"
    assert (
        default_data_dir({"XDG_DATA_HOME": "relative"}) == Path.home() / ".local" / "share" / "conveyor"
    )  # as XDG says
    assert default_data_dir({"CONVEYOR_DATA_DIR": str(tmp_path), "XDG_DATA_HOME": "/x"}) == tmp_path


def test_a_url_then_redis_url_then_the_local_server(server, home, caplog):
    elsewhere = "redis://10.0.0.5:6379"
    assert resolve_settings(elsewhere).url == elsewhere and resolve_settings(elsewhere).local_dir is None
    from_env = resolve_settings(env={"REDIS_URL": elsewhere, "XDG_DATA_HOME": str(home.parent)})
    assert from_env.url == elsewhere and from_env.password is None
    with caplog.at_level(logging.INFO, logger="conveyor.connection"):
        local = resolve_settings()
        resolve_settings()
    assert (local.url, local.password, local.local_dir) == (server.url, server.password, str(home))
    said = [r.getMessage() for r in caplog.records if "the local server" in r.getMessage()]
    assert len(said) == 1 and server.url in said[0] and server.password not in said[0]  # once, no secret
    with pytest.raises(NoServerFound, match="--redis-url.*--data-dir|--data-dir.*--redis-url"):
        resolve_settings(data_dir=home.parent / "nothing-here")


def test_client_with_no_url_and_client_with_the_printed_url_need_no_password(server, home):
    with Client() as client:
        assert client.redis.ping()
    with Client(server.url) as client:  # serve prints the URL without its password: found in the data folder
        assert client.redis.ping()


def test_the_port_stays_across_restarts_and_clients_follow_a_new_one(server, home):
    client = Client()
    client.redis.set("kept", "yes")
    port = server.port
    server.stop()
    server.port = 0  # as a new `conveyor serve` would start it
    assert server.start().port == port, "the recorded port, while it is free"
    assert client.redis.get("kept") == b"yes"  # AOF, and the client reconnected by itself
    server.stop()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        server.port = 0
        moved = server.start().port
        assert moved != port and (home / "url").read_text().strip() == server.url
        assert client.redis.get("kept") == b"yes", "the client re-read the data folder's url"
    client.close()


def test_a_second_server_on_one_data_folder_is_refused(server, home):
    with pytest.raises(EmbeddedValkeyError, match="already runs at"):
        EmbeddedValkey(home).start()
    assert server.is_running()


def test_a_client_rides_out_a_restart(server, home):
    import asyncio

    client = Client()
    client.redis.set("k", "v")
    port = server.port
    server.stop()
    server.port = 0
    comes_back = threading.Timer(1.0, server.start)  # down for a moment, as when serve restarts
    comes_back.start()
    try:
        assert client.redis.get("k") == b"v"  # issued while nothing listens: retried until it answers
    finally:
        comes_back.join()
    assert server.port == port

    async def async_get() -> bytes:
        async with AsyncClient() as async_client:
            return await async_client.redis.get("k")

    assert asyncio.run(async_get()) == b"v"
    client.close()


def test_a_stale_password_file_is_refused_as_such(server, home):
    (home / "password").write_text("wrong\n")  # a stale password file
    with Client() as client, pytest.raises(redis.AuthenticationError):
        client.redis.ping()
