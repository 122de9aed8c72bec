"""What uvicorn lacks against slow or many clients: caps on open connections, in all and per
client address, and a header timeout (a request's headers must be in within
`header_timeout_s` of the connection opening or of the previous response: slowloris
connections are closed). Bodies have their own deadline (body_limit.BodyLimit); idle
keep-alive connections uvicorn's `timeout_keep_alive`; header size h11's
`h11_max_incomplete_event_size`.

Holding connections open costs a client nothing, so one that never sends a request must not
keep others out. A connection is *trusted* once a request on it carried a valid API key (on
a gateway without keys: once any request came in); it is *idle* while no request is under
way on it. A newcomer that takes its address over `max_per_peer` (IPv6: its /64), or the
gateway over `max_connections`, replaces the connection that has been idle and untrusted
the longest (of its own address when over the address's share, else of any): that one gets
a 503 if it never had a response, and is closed. With none to replace, the newcomer gets
the 503 and is closed at once. So idle sockets of clients without a key never starve
requests that have one, and one address never holds more than its share. A newcomer is
the last in line to be replaced: before its request is in, every idle untrusted connection
opened before it must have gone."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 37\r\n"
    b"connection: close\r\n\r\ntoo many open connections, try later\n"
)

Headers = list[tuple[bytes, bytes]]


def peer_of(client: tuple[str, int] | None) -> str:
    """The address a connection counts against: its IP (IPv4-mapped IPv6 as IPv4), an IPv6's /64."""
    if not client:
        return ""
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return str(client[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Pool:
    """The connections of one server: counts per peer, and the idle untrusted ones in the
    order they became so (overall and per peer: the first is the oldest)."""

    def __init__(self) -> None:
        self.total = 0
        self.count: dict[str, int] = {}
        self.idle: dict[Any, None] = {}  # protocols idle and untrusted, in the order they became so
        self.idle_of: dict[str, dict[Any, None]] = {}  # the same per peer

    def add(self, proto: Any) -> None:
        self.total += 1
        self.count[proto.peer] = self.count.get(proto.peer, 0) + 1

    def remove(self, proto: Any) -> None:
        self.set_busy(proto)
        self.total -= 1
        left = self.count[proto.peer] - 1
        if left:
            self.count[proto.peer] = left
        else:
            del self.count[proto.peer]

    def set_idle(self, proto: Any) -> None:
        self.set_busy(proto)  # to the end of both orders
        self.idle[proto] = None
        self.idle_of.setdefault(proto.peer, {})[proto] = None

    def set_busy(self, proto: Any) -> None:
        if proto in self.idle:
            del self.idle[proto]
            own = self.idle_of[proto.peer]
            del own[proto]
            if not own:
                del self.idle_of[proto.peer]

    def victim(self, peer: str | None) -> Any:
        """The connection idle and untrusted the longest (of `peer`, or of anyone), or None."""
        order = self.idle if peer is None else self.idle_of.get(peer, {})
        return next(iter(order), None)


def limited_protocol(
    max_connections: int,
    header_timeout_s: float,
    max_per_peer: int | None = None,
    trusts: Callable[[Headers], bool] = lambda headers: True,
) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn.Config(http=...) takes a class);
    `trusts(headers)`: whether a request's headers carry a valid API key."""
    per_peer = max_per_peer or max_connections
    pool = _Pool()

    class LimitedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        peer = ""
        trusted = False
        counted = False
        answered = False  # a response went out on it
        _judged: Any = None  # the request cycle whose headers were looked at

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.peer = peer_of(self.client)
            pool.add(self)
            self.counted = True
            over_peer = pool.count[self.peer] > per_peer
            if over_peer or pool.total > max_connections:
                victim = pool.victim(self.peer if over_peer else None)
                if victim is None:
                    self._drop(busy=True)
                    return
                victim._drop(busy=not victim.answered)
            pool.set_idle(self)
            self._arm_header_timer()

        def _drop(self, busy: bool) -> None:
            """Out of the counts at once (its connection_lost comes later), a 503 if asked, closed."""
            self._forget()
            self._disarm_header_timer()
            if busy:
                self.transport.write(BUSY)
            self.transport.close()

        def _forget(self) -> None:
            if self.counted:
                self.counted = False
                pool.remove(self)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._request_under_way():  # its headers are in (h11 produced a Request)
                self._disarm_header_timer()
                self._judge()

        def on_response_complete(self) -> None:
            self.answered = True
            self._arm_header_timer()  # the next request on this connection gets as long
            super().on_response_complete()  # (which may start a pipelined one at once)
            if self._request_under_way() or self.transport.is_closing():
                self._disarm_header_timer()
                self._judge()
            elif self.counted and not self.trusted:
                pool.set_idle(self)

        def _judge(self) -> None:
            """A request's headers are in: the connection is busy, and trusted if they hold a key."""
            if self.cycle is None or self.cycle is self._judged:
                return
            self._judged = self.cycle
            self.trusted = self.trusted or trusts(self.scope["headers"])
            if self.counted:
                pool.set_busy(self)

        def _request_under_way(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def connection_lost(self, exc: Exception | None) -> None:
            self._forget()
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self._request_under_way():  # headers still coming: nothing to answer yet
                self.transport.close()

    return LimitedH11Protocol
