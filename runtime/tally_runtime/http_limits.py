"""Bounds on a request's head, where the application cannot set them: uvicorn's httptools protocol buffers a
whole head (any size, for as long as a client cares to send it) before the app sees a request.

`bounded_protocol` returns uvicorn's httptools protocol with two bounds added: a head larger than
`max_head_bytes` gets 431 and the connection is closed, and a connection that does not complete a request
head within `head_seconds` of opening (or of the first byte of its next request) is closed, so a client
sending its headers a byte at a time holds nothing for long. The body is bounded by the app (respond.py),
the number of connections by uvicorn's own `limit_concurrency`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadTooLarge(Exception):
    pass


def bounded_protocol(max_head_bytes: int, head_seconds: float) -> type[HttpToolsProtocol]:
    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_bytes = 0
            self._refused = False
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # a refused head was answered already
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_head_bytes:
                self._refuse(b"431 Request Header Fields Too Large", f"request head larger than {max_head_bytes} bytes")
                raise HeadTooLarge()  # stops the parser; uvicorn's 400 is suppressed above

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(head_seconds, self._head_timed_out)

        def _disarm(self) -> None:
            timer: Any = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request in progress: idle or slow head
                self._refuse(b"408 Request Timeout", f"no complete request head within {head_seconds:g}s")

        def _refuse(self, status: bytes, why: str) -> None:
            self._refused = True
            self.logger.info("Refused a request from %s: %s", self.client, why)
            body = why.encode()
            self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

    return BoundedHttpToolsProtocol
