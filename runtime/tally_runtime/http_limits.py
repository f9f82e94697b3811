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
  authentication refusal (`Connection: close`). With `probation` (the runtime's API port), a connection past
  its address's bound is not refused: it must authenticate within that many seconds, or it is closed, and
  while it has not, a connection that finds the port full takes its place (the oldest on probation goes).
  Every client behind one address (a gateway, a mesh, a NAT) opens its connections at once and authenticates
  within milliseconds; refused at connect, 84 of 100 SDK clients behind one relay got 429s. So an address
  holds no more than its bound of unauthenticated connections that keep anyone else out, as before;
- a full port makes room for a newcomer by closing the connection idle the longest (a second at least: kept
  alive with nothing under way), so idle connections from a few addresses cannot keep the probes out;
- every refusal is the OpenAI error envelope (`{"error": {"message", "type", "param", "code"}}`) with
  `Retry-After` where trying again may help, so an SDK knows what it got;
- once the server drains, every response closes its connection and idle keep-alive connections are
  closed, so a pooled client's next request opens a new connection, which the Service sends elsewhere.
The body's size is bounded by the app (respond.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tally_runtime.client_watch import HANG_UP
from tally_runtime.protocol import error_type

log = logging.getLogger("tally_runtime.http")

# The scope key under which the app finds its connection's hook: called once a request on it authenticated
AUTHENTICATED = "tally.authenticated"
IDLE_EVICT_SECONDS = 1.0  # a connection idle this long gives its place to a newcomer on a full port


class HeadTooLarge(Exception):
    pass


class Connections:
    """Every open connection, by the port it came in on. `caps` maps a listening port to the connections
    it may hold (a port not named is capped by `default_cap`); `unauthenticated_per_client` bounds the
    connections one client address may hold before any request on them authenticated (0: no bound, as
    without API keys, where nothing authenticates)."""

    def __init__(self, caps: Mapping[int, int], default_cap: int, unauthenticated_per_client: int = 0,
                 authenticated_ports: frozenset[int] = frozenset(), per_client_caps: Mapping[int, int] | None = None,
                 per_tenant: int = 0, probation: float = 0.0) -> None:
        self.probation = probation  # > 0: a connection past its address's bound may stay that long unauthenticated
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
        self.on_probation: dict[int, dict[Any, None]] = {}  # port -> its connections on probation, oldest first
        self.closing = False  # draining: every response closes its connection
        self.on_refused: Callable[[str], object] | None = None  # counts each refusal by why (the app's metric)

    def bounds_client(self, port: int) -> bool:
        """Whether a connection on `port` counts against its client's pre-authentication bound."""
        return bool(self.unauthenticated_per_client) and port in self.authenticated_ports

    def admit(self, protocol: Any, port: int, client: str) -> str:
        """Count a new connection in; a non-empty answer is why it is refused (and it is not counted), "probation"
        that it is counted but must authenticate within `probation` seconds."""
        on_port = self.open.setdefault(port, set())
        if len(on_port) >= self.caps.get(port, self.default_cap):
            oldest = next(iter(self.on_probation.get(port, {})), None)
            if oldest is not None:
                oldest.evict()  # on probation, not authenticated yet: it makes room (and is released now)
            elif (idlest := self._idlest(on_port)) is not None:
                idlest.evict(idle=True)  # kept alive with nothing to do: closed, as a keep-alive timeout would
                self._refused("idle")
            else:
                return self._refused("port")
        bounded = self.bounds_client(port)
        past = bounded and self.unauthenticated[client] >= self.unauthenticated_per_client
        if past and not self.probation:
            return self._refused("client")
        if port in self.per_client_caps and self.by_client[port, client] >= self.per_client_caps[port]:
            return self._refused("client")
        on_port.add(protocol)
        if bounded:
            self.unauthenticated[client] += 1
        if port in self.per_client_caps:
            self.by_client[port, client] += 1
        if past:
            self.on_probation.setdefault(port, {})[protocol] = None
            return "probation"
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

    @staticmethod
    def _idlest(on_port: set[Any]) -> Any:
        """The connection on the port idle the longest (no request, nothing of one received), if any has been for
        `IDLE_EVICT_SECONDS`: a full port makes room for a newcomer by closing it. Idle keep-alive connections
        from a few addresses filled a metrics port (the kubelet's probes and the operator's scrape got 503)."""
        now = asyncio.get_running_loop().time()
        idle = [(p.idle_since(), id(p), p) for p in on_port]
        since, _, protocol = min(((t, i, p) for t, i, p in idle if t is not None), default=(None, 0, None),
                                 key=lambda item: (item[0], item[1]))
        return protocol if since is not None and now - since >= IDLE_EVICT_SECONDS else None

    def off_probation(self, protocol: Any, port: int) -> None:
        self.on_probation.get(port, {}).pop(protocol, None)

    def release(self, protocol: Any, port: int, client: str, unauthenticated: bool) -> None:
        self.open.get(port, set()).discard(protocol)
        self.off_probation(protocol, port)
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


def refusal_body(status: int, message: str, code: str) -> bytes:
    """PURE: a refusal in the OpenAI error envelope (protocol.ApiError's), as bytes."""
    return json.dumps({"error": {"message": message, "type": error_type(status), "param": None,
                                 "code": code or None}}).encode()


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
            self._probation: asyncio.TimerHandle | None = None
            self._idle_at = self.loop.time()
            if connections is not None:
                why = connections.admit(self, self._port, self._client)
                if why and why != "probation":
                    self._refuse_connection(why)
                    return
                self._counted = True
                self._unauthenticated = connections.bounds_client(self._port)
                if why == "probation":
                    self._probation = self.loop.call_later(connections.probation, self._probation_over)
            self._arm(head_seconds)

        def _refuse_connection(self, why: str) -> None:
            if why == "client":
                self._refuse(b"429 Too Many Requests", "too many connections from this client address before any "
                             "of them authenticated; send the API key at once, or retry", quiet=True,
                             code="rate_limit_exceeded")
            else:
                self._refuse(b"503 Service Unavailable", "this server holds as many connections as it may; retry "
                             "(another pod may take it)", quiet=True, code="overloaded")

        def _probation_over(self) -> None:
            """Past its address's bound and still not authenticated: it goes (once its response, if one is under
            way, is done)."""
            self._probation = None
            if not self._unauthenticated or self._refused or connections is None:
                return
            connections.off_probation(self, self._port)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
                return
            connections._refused("client")
            self._refuse_connection("client")

        def evict(self, idle: bool = False) -> None:
            """The port is full: closed at once and released now (the newcomer takes its place). On probation, it
            is told why (429); `idle`, a kept-alive connection with nothing under way, it is just closed."""
            if connections is None or not self._counted:
                return
            self._counted = False
            connections.release(self, self._port, self._client, self._unauthenticated)
            self._unauthenticated = False
            if idle:
                self._refused = True
                self.transport.close()
                return
            connections._refused("client")
            if not self._refused:
                self._refuse_connection("client")

        def idle_since(self) -> float | None:
            """When the connection last had anything to do, or None while it does (a request under way or
            arriving)."""
            if self._refused or self._head_bytes or (self.cycle is not None and not self.cycle.response_complete):
                return None
            return self._idle_at

        def on_response_complete(self) -> None:
            self._idle_at = self.loop.time()
            self._head_bytes = 0  # nothing of a next request yet
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if getattr(self, "_probation", None) is not None:
                self._probation.cancel()  # type: ignore[union-attr]
                self._probation = None
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
                connections.off_probation(self, self._port)
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
                self._refuse(b"431 Request Header Fields Too Large", f"request head larger than {max_head_bytes} bytes",
                             code="request_head_too_large", retry=False)
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
                self._refuse(b"408 Request Timeout", f"no complete request head within {head_seconds:g}s",
                             code="request_timeout")
            elif self.cycle.more_body:  # the head came, the body did not finish in time
                if self.cycle.response_started:  # the app answered already (a refusal): just end it
                    self._refused = True
                    self.transport.close()
                else:
                    self._refuse(b"408 Request Timeout", f"no complete request body within {body_seconds:g}s",
                                 code="request_timeout")

        def _refuse(self, status: bytes, why: str, quiet: bool = False, code: str = "", retry: bool = True) -> None:
            self._refused = True
            (log.debug if quiet else log.info)("Refused a request from %s: %s", self.client, why)
            body = refusal_body(int(status.split()[0]), why, code)
            self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                                 + (b"retry-after: 1\r\n" if retry else b"")
                                 + b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

    return BoundedHttpToolsProtocol

