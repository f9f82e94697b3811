"""Bounds on connections where the application cannot set them, before anyone is authenticated: uvicorn's
httptools protocol buffers a whole head (any size, for as long as a client cares to send it) and a body
(as slowly as it comes) before the app decides anything, and counts one connection limit for every port.

`bounded_protocol` returns uvicorn's httptools protocol with these bounds added:
- a head larger than `max_head_bytes` gets 431, and one not complete within `head_seconds` of the
  connection opening (or of the first byte of its next request) gets 408; a body not complete within
  `body_seconds` of its head gets 408 too, so a client trickling bytes holds nothing for long;
- `Connections` caps open connections per listening port (the metrics port, where the kubelet's probes
  and the operator's scrape arrive, has capacity of its own that API clients cannot take), per client address
  on a port that has a cap of that kind (the metrics port: a few addresses must not take all of it), with API
  keys per client address before that client's first authenticated request, and per tenant once it is
  authenticated (one key must not hold every API connection); the app closes the connection after an
  authentication refusal (`Connection: close`);
- once the server drains, every response closes its connection and idle keep-alive connections are
  closed, so a pooled client's next request opens a new connection, which the Service sends elsewhere.
The body's size is bounded by the app (respond.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tally_runtime.client_watch import HANG_UP

log = logging.getLogger("tally_runtime.http")

# The scope key under which the app finds its connection's hook: called once a request on it authenticated
AUTHENTICATED = "tally.authenticated"


class HeadTooLarge(Exception):
    pass


class Connections:
    """Every open connection, by the port it came in on. `caps` maps a listening port to the connections
    it may hold (a port not named is capped by `default_cap`); `unauthenticated_per_client` bounds the
    connections one client address may hold before any request on them authenticated (0: no bound, as
    without API keys, where nothing authenticates)."""

    def __init__(self, caps: Mapping[int, int], default_cap: int, unauthenticated_per_client: int = 0,
                 authenticated_ports: frozenset[int] = frozenset(), per_client_caps: Mapping[int, int] | None = None,
                 per_tenant: int = 0) -> None:
        self.caps = dict(caps)
        self.default_cap = default_cap
        self.unauthenticated_per_client = unauthenticated_per_client
        self.authenticated_ports = authenticated_ports  # where the per-client bound applies (the API port)
        self.per_client_caps = dict(per_client_caps or {})  # port -> connections one address may hold there
        self.per_tenant = per_tenant  # authenticated connections one tenant may hold (0: no bound)
        self.open: dict[int, set[Any]] = {}
        self.unauthenticated: Counter[str] = Counter()
        self.by_client: Counter[tuple[int, str]] = Counter()  # on ports with a per-client cap
        self.by_tenant: Counter[str] = Counter()
        self.closing = False  # draining: every response closes its connection
        self.on_refused: Callable[[str], object] | None = None  # counts each refusal by why (the app's metric)

    def bounds_client(self, port: int) -> bool:
        """Whether a connection on `port` counts against its client's pre-authentication bound."""
        return bool(self.unauthenticated_per_client) and port in self.authenticated_ports

    def admit(self, protocol: Any, port: int, client: str) -> str:
        """Count a new connection in; a non-empty answer is why it is refused (and it is not counted)."""
        on_port = self.open.setdefault(port, set())
        if len(on_port) >= self.caps.get(port, self.default_cap):
            return self._refused("port")
        bounded = self.bounds_client(port)
        if bounded and self.unauthenticated[client] >= self.unauthenticated_per_client:
            return self._refused("client")
        if port in self.per_client_caps and self.by_client[port, client] >= self.per_client_caps[port]:
            return self._refused("client")
        on_port.add(protocol)
        if bounded:
            self.unauthenticated[client] += 1
        if port in self.per_client_caps:
            self.by_client[port, client] += 1
        return ""

    def tenant(self, protocol: Any, tenant: str) -> bool:
        """The connection's requests are the tenant's; False (nothing counted) when the tenant already holds
        `per_tenant` connections. A connection counts once, for the tenant of its latest request."""
        current = getattr(protocol, "tally_tenant", None)
        if current == tenant or not self.per_tenant:
            return True
        if self.by_tenant[tenant] >= self.per_tenant:
            self._refused("tenant")
            return False
        self._untenant(protocol)
        self.by_tenant[tenant] += 1
        protocol.tally_tenant = tenant
        return True

    def _untenant(self, protocol: Any) -> None:
        tenant = getattr(protocol, "tally_tenant", None)
        if tenant is not None:
            protocol.tally_tenant = None
            self.by_tenant[tenant] -= 1
            if self.by_tenant[tenant] <= 0:
                del self.by_tenant[tenant]

    def _refused(self, why: str) -> str:
        if self.on_refused is not None:
            self.on_refused(why)
        return why

    def authenticated(self, client: str) -> None:
        if self.unauthenticated[client] > 1:
            self.unauthenticated[client] -= 1
        else:
            del self.unauthenticated[client]

    def release(self, protocol: Any, port: int, client: str, unauthenticated: bool) -> None:
        self.open.get(port, set()).discard(protocol)
        if unauthenticated:
            self.authenticated(client)
        if port in self.per_client_caps:
            self.by_client[port, client] -= 1
            if self.by_client[port, client] <= 0:
                del self.by_client[port, client]
        self._untenant(protocol)

    def close_after_responses(self) -> None:
        """From now on no connection is kept alive: idle ones close at once, and every response not started
        yet says `connection: close` and closes its connection. A response already under way (a stream) is
        left alone: closing its connection right after it would race the client's next request on it (a
        reset); that request instead gets the drain's 503 with `connection: close`, which a client retries on
        a new connection. A connection that has not had a request yet is left alone too: its first request
        may be on its way (closing it reset the operator's poll of /metrics at the start of a drain); its
        response closes it, and the head timeout bounds one that never sends."""
        self.closing = True
        for protocol in [p for port in self.open.values() for p in port]:
            cycle = protocol.cycle
            if cycle is not None and cycle.response_complete:
                protocol.transport.close()
            elif cycle is not None and not cycle.response_started:
                cycle.keep_alive = False


def bounded_protocol(max_head_bytes: int, head_seconds: float, body_seconds: float = 30.0,
                     connections: Connections | None = None) -> type[HttpToolsProtocol]:
    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_bytes = 0
            self._refused = False
            self._head_timer: asyncio.TimerHandle | None = None
            self._counted = False
            self._unauthenticated = False
            if connections is not None:
                why = connections.admit(self, self._port, self._client)
                if why:
                    status = b"429 Too Many Requests" if why == "client" else b"503 Service Unavailable"
                    self._refuse(status, "too many connections" + (" from this client before it authenticated"
                                                                   if why == "client" else ""), quiet=True)
                    return
                self._counted = True
                self._unauthenticated = connections.bounds_client(self._port)
            self._arm(head_seconds)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted and connections is not None:
                self._counted = False
                connections.release(self, self._port, self._client, self._unauthenticated)
            super().connection_lost(exc)

        @property
        def _port(self) -> int:
            return int((self.server or ("", 0))[1] or 0)

        @property
        def _client(self) -> str:
            return str((self.client or ("", 0))[0])

        def hang_up(self) -> None:
            """End the connection now (a stream whose client stopped reading: client_watch.StallGuard)."""
            if not self.transport.is_closing():
                self.transport.abort()

        def mark_authenticated(self, tenant: str = "") -> bool:
            """The request on this connection authenticated (as `tenant`); False when that tenant holds its
            share of connections already (the app refuses the request and closes this one)."""
            if connections is None:
                return True
            if self._unauthenticated:
                self._unauthenticated = False
                connections.authenticated(self._client)
            return not tenant or connections.tenant(self, tenant)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # a refused head was answered already
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope[AUTHENTICATED] = self.mark_authenticated  # type: ignore[literal-required]
            self.scope[HANG_UP] = self.hang_up  # type: ignore[literal-required]
            self._head_bytes = 0
            self._arm(head_seconds)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._arm(body_seconds)  # the body, if any, must follow within its own bound
            super().on_headers_complete()
            if connections is not None and connections.closing and self.cycle is not None:
                self.cycle.keep_alive = False  # draining: the response says `connection: close`

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_head_bytes:
                self._refuse(b"431 Request Header Fields Too Large", f"request head larger than {max_head_bytes} bytes")
                raise HeadTooLarge()  # stops the parser; uvicorn's 400 is suppressed above

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            timer: Any = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request in progress: idle or slow head
                self._refuse(b"408 Request Timeout", f"no complete request head within {head_seconds:g}s")
            elif self.cycle.more_body:  # the head came, the body did not finish in time
                if self.cycle.response_started:  # the app answered already (a refusal): just end it
                    self._refused = True
                    self.transport.close()
                else:
                    self._refuse(b"408 Request Timeout", f"no complete request body within {body_seconds:g}s")

        def _refuse(self, status: bytes, why: str, quiet: bool = False) -> None:
            self._refused = True
            (log.debug if quiet else log.info)("Refused a request from %s: %s", self.client, why)
            body = why.encode()
            self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

    return BoundedHttpToolsProtocol

