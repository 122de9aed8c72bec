"""What uvicorn lacks against slow or many clients: a cap on open connections (one over it
gets a 503 and is closed at once) and a header timeout (a request's headers must be in
within `header_timeout_s` of the connection opening or of the previous response: slowloris
connections are closed). Bodies have their own deadline (body_limit.BodyLimit); idle
keep-alive connections uvicorn's `timeout_keep_alive`; header size h11's
`h11_max_incomplete_event_size`."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 37\r\n"
    b"connection: close\r\n\r\ntoo many open connections, try later\n"
)


def limited_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn.Config(http=...) takes a class)."""

    class LimitedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(BUSY)
                transport.close()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._request_under_way():  # its headers are in (h11 produced a Request)
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            self._arm_header_timer()  # the next request on this connection gets as long
            super().on_response_complete()  # (which may start a pipelined one at once)
            if self._request_under_way() or self.transport.is_closing():
                self._disarm_header_timer()

        def _request_under_way(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def connection_lost(self, exc: Exception | None) -> None:
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
