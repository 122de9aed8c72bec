"""Against DNS rebinding: a page of another site whose name the attacker points at 127.0.0.1
(or at any address of the gateway's machine) reaches the gateway from the victim's browser,
and a gateway without API keys would answer it all, the dashboard's actions included. Such
a request carries the attacker's name in its `Host` header (a page cannot set that header),
so only the names the gateway is reached by are answered; any other gets a 400 naming the
header.

Always answered: `localhost`, IP addresses (an IP literal is never resolved, so never
rebound) and the gateway's own `--host` when it is a name. More names: `--allowed-hosts`
(`a.example.com,*.b.example.com`; `*` answers any). The port is not compared: the header
names the address the browser connected to, which only the name's owner chooses. A request
without Host (HTTP/1.0: never a browser's) passes."""

from __future__ import annotations

import ipaddress
import json
from typing import Any, Callable

from conveyor.apps.openai_api.errors import OpenAIError

ALWAYS = frozenset({"localhost"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "*"})


class HostPolicy:
    """Which Host header names are answered (module docstring)."""

    def __init__(self, allowed: str | None, bind_host: str = "") -> None:
        entries = [entry.strip().lower().rstrip(".") for entry in (allowed or "").split(",")]
        entries = [entry for entry in entries if entry]
        for entry in entries:
            if any(c.isspace() or c in "/@?#" for c in entry) or ("*" in entry and entry != "*" and not _suffix(entry)):
                raise ValueError(f"allowed_hosts: {entry!r} is not a host name, '*.<domain>' or '*'")
        self.any = "*" in entries
        self.names = set(ALWAYS) | {e for e in entries if not e.startswith("*")}
        self.suffixes = tuple(e[1:] for e in entries if e.startswith("*."))
        bind = bind_host.strip().lower().rstrip(".")
        if bind not in WILDCARD_BINDS and _ip(bind) is None:
            self.names.add(bind)

    def allows(self, host: str) -> bool:
        if self.any:
            return True
        name = hostname(host)
        if name in self.names or _ip(name) is not None:
            return True
        return bool(self.suffixes) and name.endswith(self.suffixes)


def hostname(host: str) -> str:
    """The name of a Host header value, without its port: `[::1]:8000` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _ip(name: str) -> Any:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _suffix(entry: str) -> bool:
    return entry.startswith("*.") and "*" not in entry[2:] and len(entry) > 2


class AllowedHosts:
    """Pure ASGI: HTTP requests whose Host the policy does not answer get a 400."""

    def __init__(self, app: Any, policy: HostPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or self.policy.any:
            return await self.app(scope, receive, send)
        host = next((value for name, value in scope.get("headers", ()) if name == b"host"), None)
        if host is None or self.policy.allows(host.decode("latin-1")):
            return await self.app(scope, receive, send)
        shown = host.decode("latin-1")[:100]
        error = OpenAIError(
            400,
            f"the Host header {shown!r} is not a name this gateway answers to (DNS rebinding guard): "
            "use localhost or an IP address, or allow the name with --allowed-hosts "
            "(env CONVEYOR_GATEWAY_ALLOWED_HOSTS)",
            param="Host",
            code="invalid_host",
        )
        body = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
