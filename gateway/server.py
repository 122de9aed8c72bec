"""Runs the gateway app under uvicorn (`conveyor gateway`, or a test's thread)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import uvicorn
from fastapi import APIRouter

from conveyor.gateway.app import create_app
from conveyor.gateway.connection_limits import limited_protocol
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.tenants import KeyRing, bearer_token

MAX_HEADER_BYTES = 16 * 1024  # request line and headers (h11's bound of an incomplete event)
GRACEFUL_SHUTDOWN_S = 10  # open streams get this long after SIGTERM; then their jobs are cancelled


def make_server(
    settings: GatewaySettings, extra_routers: Iterable[APIRouter] = (), api: bool = True, **options: Any
) -> uvicorn.Server:
    """A uvicorn Server of the app on settings.host:settings.port (`options` go to uvicorn.Config);
    `api=False`: the dashboard's program (no /v1 routes)."""
    app = create_app(settings, extra_routers, api)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=settings.keep_alive_s,
        http=limited_protocol(
            settings.max_connections,
            settings.header_timeout_s,
            settings.max_connections_per_peer,
            key_trust(app.state.keyring),
        ),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **options,
    )
    return uvicorn.Server(config)


def key_trust(keyring: KeyRing) -> Callable[[list[tuple[bytes, bytes]]], bool]:
    """Whether a request's headers make its connection trusted (connection_limits): a valid
    API key; without keys configured, any request."""
    if not keyring.enabled:
        return lambda headers: True

    def trusts(headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            if name == b"authorization":
                key = bearer_token(value.decode("latin-1"))
                return key is not None and keyring.grant_for(key) is not None
        return False

    return trusts


def serve(settings: GatewaySettings, extra_routers: Iterable[APIRouter] = (), api: bool = True) -> int:
    """Serve until SIGINT/SIGTERM; exit code 0, or 1 when the server could not start."""
    server = make_server(settings, extra_routers, api)
    server.run()
    return 0 if server.started else 1
