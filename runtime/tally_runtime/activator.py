"""`tally-runtime activate`: the activator of a service scaled to zero (docs/DESIGN.md, "Scale to zero").

While a CompletionService has no ready pod, the operator points its Service at these pods. Each request is
held in a bounded FIFO until a pod behind the backend Service (`<name>-pods`: the runtime pods, ready ones
only) answers, then sent there and its response streamed back unchanged: the client sees one ordinary
response, later. The operator long-polls `/held` on the metrics port, so a held request asks for a pod at
once, not at the next scrape.

What it never does: bill (the pod counts what it generates; a request that times out here never reached a
model), read API keys (the pod authenticates the forwarded request), or hold without bounds. It faces every
client unauthenticated, so it has the runtime's connection bounds (http_limits.py: a head within 10 s and
64 KiB, a body within 30 s, connections per port and per client address) and a slot per request, taken before
its body is read and kept until the pod's response head arrives: at most `max_held` bodies (each at most
`max_body_bytes`) are in memory at once, whatever clients send, and the operator sizes the pod's memory from
that product. A refusal is the OpenAI 503 envelope with `Retry-After`. Every request, held or not, is forwarded
once a pod answers, and every forwarded response closes its connection (`Connection: close`): a pooled client
then reconnects through the Service, which by then points at the pods, instead of staying here.

Behind an InferencePool (`--model-server-metrics`) the operator switches the pool to these pods too, and the
endpoint picker scrapes `/metrics` on the API port many times a second: that is answered here with the
picker's gauges (what is held is the queue, what is being relayed is running), never held or forwarded, so
a picker's scrapes never wake the service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tally_runtime import pool_metrics
from tally_runtime.engine.base import CacheLoad
from tally_runtime.http_limits import Connections, bounded_protocol
from tally_runtime.settings import KEEP_ALIVE_SECONDS

log = logging.getLogger("tally_runtime.activator")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

# Hop-by-hop headers (RFC 9110 §7.6.1) and those httpx or uvicorn set for their own connection
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length"})
MAX_WAIT_SECONDS = 30.0  # the longest /held long-poll
FRESH_SECONDS = 1.0  # a probe this recent that found a pod lets a request through without holding it
# Forwards waiting for their response's head at once: with API keys the pod holds at most 16 connections from
# one address before a request on them authenticates (--max-unauthenticated-connections-per-client), and
# every forwarded request comes from this pod's address; the rest wait their turn here, still in order.
FORWARDS_OPENING = 12


@dataclass(frozen=True, slots=True)
class ActivatorSettings:
    service: str  # namespace/name, for messages and logs
    backend: str  # the runtime pods' Service, e.g. http://chat-pods.team.svc:8000
    port: int = 8000
    metrics_port: int = 8001
    host: str = "::"
    max_held: int = 64  # requests in hand at once (their bodies being read, held, or being forwarded); more get 503
    hold_seconds: float = 300.0  # how long a request waits for a ready pod before its 503
    max_body_bytes: int = 4 << 20
    probe_seconds: float = 0.25  # between probes of the backend while something is held
    picker_model: str | None = None  # behind an InferencePool: the model named by the picker's gauges
    max_connections: int = 1024  # on the API port (the metrics port holds METRICS_CONNECTIONS of its own)
    max_connections_per_client: int = 64  # one client address's share of them


METRICS_CONNECTIONS = 16  # the kubelet's probes and the operator's long-poll
HEAD_SECONDS, BODY_SECONDS, MAX_HEAD_BYTES = 10.0, 30.0, 64 << 10  # as the runtime's defaults


class Refusal(Exception):
    """A request answered here with the OpenAI error envelope; nothing reached a model."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after

    def response(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        kind = "service_unavailable_error" if self.status == 503 else "invalid_request_error"
        body = orjson.dumps({"error": {"message": self.message, "type": kind, "param": None, "code": self.code}})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        return self.status, headers, body


class ClientGone(Exception):
    """The client disconnected: nothing more to send it."""


class ActivatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.held = Gauge("tally_activator_held_requests", "Requests held now, waiting for a ready pod",
                          registry=self.registry)
        self.requests = Counter("tally_activator_requests", "Requests by outcome: forwarded after holding, "
                                "relayed (a pod was ready), timeout, overflow, too_large, invalid, gone (the client "
                                "left while held), upstream_error", ["outcome"], registry=self.registry)
        self.cold_start = Histogram("tally_activator_cold_start_seconds", "From a request held to its response's "
                                    "first byte from the pod", buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
                                    registry=self.registry)
        self.last_cold_start = Gauge("tally_activator_last_cold_start_seconds", "The most recent held request's "
                                     "held-to-first-byte time", registry=self.registry)


class Activator:
    """The held-request queue and the backend probe. One per process; touched only from its event loop."""

    def __init__(self, settings: ActivatorSettings, client: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = ActivatorMetrics()
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=600.0, write=30.0, pool=5.0), trust_env=False,
            limits=httpx.Limits(max_connections=settings.max_held * 2 + 64, max_keepalive_connections=32))
        self.clock = clock
        self.waiting: deque[asyncio.Future[None]] = deque()  # FIFO of held requests
        self.ready_at = -1e9  # when a probe last found a pod answering
        self.last_cold_start: float | None = None
        self._prober: asyncio.Task[None] | None = None
        self._opening = asyncio.Semaphore(FORWARDS_OPENING)
        self._held_changed = asyncio.Event()
        self.relaying = 0  # requests sent on to a pod whose responses are not over yet
        self.stopping = False  # shutting down: every request, new or held, gets a 503 to retry (never a 500)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, for a stop signalled from outside it
        self.in_hand = 0  # requests whose body is being read, held, or sent on until the pod's response head

    # ---- the queue

    @property
    def held(self) -> int:
        return len(self.waiting)

    def pod_fresh(self) -> bool:
        return self.clock() - self.ready_at < FRESH_SECONDS

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of `max_held` places for a request in hand, taken before its body is read (Refusal when none is
        free: nothing is read), given back once the pod's response head arrived or the request ended."""
        if self.in_hand >= self.settings.max_held:
            self.metrics.requests.labels("overflow").inc()
            raise Refusal(503, f"{self.settings.service} is starting from zero and already has "
                               f"{self.settings.max_held} requests in hand; retry later", "service_starting",
                          retry_after=max(1, int(self.settings.hold_seconds // 10)))
        self.in_hand += 1
        try:
            yield
        finally:
            self.in_hand -= 1

    async def hold(self) -> None:
        """Wait, in arrival order, until a probe finds a pod; Refusal when held too long (the request's slot
        bounds how many wait)."""
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        self._changed()
        if self._prober is None or self._prober.done():
            self._prober = asyncio.create_task(self._probe_until_empty())
        try:
            await asyncio.wait_for(asyncio.shield(ticket), self.settings.hold_seconds)
            if self.stopping:
                raise Refusal(503, f"The activator of {self.settings.service} is shutting down; retry",
                              "shutting_down", retry_after=1)
        except TimeoutError:
            self.metrics.requests.labels("timeout").inc()
            raise Refusal(503, f"No pod of {self.settings.service} became ready within "
                               f"{self.settings.hold_seconds:g}s; the request never reached a model and is not "
                               "billed", "service_starting", retry_after=max(1, int(self.settings.hold_seconds // 10))
                          ) from None
        finally:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
            if not ticket.done():
                ticket.cancel()
            self._changed()

    def stop(self) -> None:
        """Shutting down: the held requests end now with a 503 to retry (the Service points at a pod or at the
        next activator), and none is held or sent from here on."""
        self.stopping = True
        for ticket in self.waiting:
            if not ticket.done():
                ticket.set_result(None)

    def _changed(self) -> None:
        self.metrics.held.set(self.held)
        self._held_changed.set()
        self._held_changed = asyncio.Event()

    async def _probe_until_empty(self) -> None:
        while self.waiting:
            if await self.probe():
                self.ready_at = self.clock()
                for ticket in self.waiting:  # in arrival order; each leaves the queue itself
                    if not ticket.done():
                        ticket.set_result(None)
                return
            await asyncio.sleep(self.settings.probe_seconds)

    async def probe(self) -> bool:
        """Does a ready pod answer behind the backend Service? Any answer but 503 (a draining pod) is one;
        kube-proxy refuses the connection while the Service has no ready endpoint."""
        try:
            response = await self.client.get(self.settings.backend + "/v1/models", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code != 503

    async def wait_held(self, seconds: float) -> int:
        """The operator's long-poll: the held count as soon as it is above zero, or after `seconds`."""
        deadline = self.clock() + min(max(seconds, 0.0), MAX_WAIT_SECONDS)
        while self.held == 0 and self.clock() < deadline:
            changed = self._held_changed
            try:
                await asyncio.wait_for(changed.wait(), deadline - self.clock())
            except TimeoutError:
                break
        return self.held

    # ---- the HTTP side

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope.get("server") and scope["server"][1] == self.settings.metrics_port:
            await self._metrics_port(scope, send)
            return
        if self.settings.picker_model is not None and scope["path"] == "/metrics" and scope["method"] == "GET":
            await _reply(send, 200, pool_metrics.CONTENT_TYPE.encode(),
                         pool_metrics.render(self.settings.picker_model, self.held, self.relaying, CacheLoad()))
            return
        try:
            if self.stopping:
                raise Refusal(503, f"The activator of {self.settings.service} is shutting down; retry", "shutting_down",
                              retry_after=1)
            await self._relay(scope, receive, send)
        except ClientGone:
            return
        except Refusal as refusal:
            status, headers, body = refusal.response()
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.stop()
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _metrics_port(self, scope: Scope, send: Send) -> None:
        path = scope["path"]
        if path == "/metrics":
            body, kind = generate_latest(self.metrics.registry), b"text/plain; version=0.0.4"
        elif path == "/health":
            body, kind = b'{"status":"ok"}', b"application/json"
        elif path == "/held":
            wait = _query_float(scope.get("query_string", b""), "wait")
            held = await self.wait_held(wait)
            body = orjson.dumps({"held": held, "lastColdStartSeconds": self.last_cold_start})
            kind = b"application/json"
        else:
            await _reply(send, 404, b"application/json", b'{"error":"not found"}')
            return
        await _reply(send, 200, kind, body)

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP_BY_HOP]
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        if not path.startswith(b"/"):  # `OPTIONS *` or an absolute URI: nothing a pod serves (fuzzer's finding)
            self.metrics.requests.labels("invalid").inc()
            raise Refusal(400, "The request target must be a path", "invalid_request")
        url = self.settings.backend + path.decode("latin-1") + (("?" + query.decode("latin-1")) if query else "")
        with self.slot():
            self._check_length(scope)
            body = await self._body(receive)
            held_at = None
            if not self.pod_fresh():
                held_at = self.clock()
                await self._while_connected(self.hold(), receive)
            request = self.client.build_request(scope["method"], url, headers=headers, content=body)
            del body
            self.relaying += 1  # from here what the picker's gauges call running, until its response is over
            try:
                response = await self._open(request, held_at, receive)
            except BaseException:
                self.relaying -= 1
                raise
        try:
            await self._forward(response, receive, send)
        finally:
            self.relaying -= 1

    async def _open(self, request: httpx.Request, held_at: float | None, receive: Receive) -> httpx.Response:
        """The pod's response head (its body still to come)."""
        try:
            response = await self._while_connected(self._send(request), receive)
        except (httpx.HTTPError, RuntimeError) as err:  # RuntimeError: the client closed as the process stops
            self.metrics.requests.labels("upstream_error").inc()
            raise Refusal(503, f"The pod of {self.settings.service} could not be reached ({type(err).__name__}); "
                               "retry", "service_starting", retry_after=1) from None
        if held_at is not None:
            self.last_cold_start = self.clock() - held_at
            self.metrics.cold_start.observe(self.last_cold_start)
            self.metrics.last_cold_start.set(self.last_cold_start)
        self.metrics.requests.labels("forwarded" if held_at is not None else "relayed").inc()
        return response

    async def _forward(self, response: httpx.Response, receive: Receive, send: Send) -> None:
        """The pod's response, streamed back unchanged but for one header: the connection closes after it, so a
        pooled client's next request opens a new one through the Service, which points at the pods by now."""
        try:
            headers = [(k, v) for k, v in response.headers.raw
                       if k.decode("latin-1").lower() not in HOP_BY_HOP - {"content-length"}]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [*headers, (b"connection", b"close")]})
            await self._while_connected(self._stream(response, send), receive)
        finally:
            await response.aclose()

    def _check_length(self, scope: Scope) -> None:
        """A body its Content-Length says is too large is refused before a byte of it is read."""
        for name, value in scope["headers"]:
            if name.lower() == b"content-length" and value.isdigit() and int(value) > self.settings.max_body_bytes:
                self.metrics.requests.labels("too_large").inc()
                raise Refusal(413, f"The request body is larger than {self.settings.max_body_bytes} bytes",
                              "request_too_large")

    async def _send(self, request: httpx.Request) -> httpx.Response:
        async with self._opening:
            return await self.client.send(request, stream=True)

    @staticmethod
    async def _stream(response: httpx.Response, send: Send) -> None:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                self.metrics.requests.labels("too_large").inc()
                raise Refusal(413, f"The request body is larger than {self.settings.max_body_bytes} bytes",
                              "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _while_connected(self, work: Awaitable[T], receive: Receive) -> T:
        """Run `work` until it ends or the client disconnects (then it is cancelled: a held request leaves
        the queue; a relayed stream closes its connection to the pod, which bills what it generated)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            gone.cancel()
        if not task.done() or task.cancelled():
            self.metrics.requests.labels("gone").inc()
            raise ClientGone
        return task.result()


async def _reply(send: Send, status: int, kind: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": body})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _query_float(query: bytes, name: str) -> float:
    for pair in query.decode("latin-1").split("&"):
        key, _, value = pair.partition("=")
        if key == name:
            try:
                number = float(value)
            except ValueError:
                return 0.0
            return number if number == number else 0.0  # NaN waits not at all
    return 0.0


def parse_args(argv: Sequence[str]) -> ActivatorSettings:
    parser = argparse.ArgumentParser(prog="tally-runtime activate", allow_abbrev=False,
                                     description="Hold a scaled-to-zero service's requests until a pod is ready.")
    parser.add_argument("--service", required=True, help="namespace/name of the CompletionService")
    parser.add_argument("--backend", required=True, help="the runtime pods' Service URL, e.g. http://x-pods:8000")
    parser.add_argument("--host", default="::")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8001)
    parser.add_argument("--max-held", type=int, default=64)
    parser.add_argument("--hold-seconds", type=float, default=300.0)
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20)
    parser.add_argument("--model-server-metrics", action="store_true",
                        help="behind an InferencePool: answer the endpoint picker's /metrics on the API port")
    parser.add_argument("--served-model-name", default="", help="the model the picker's gauges name")
    parser.add_argument("--max-connections", type=int, default=1024, help="connections the API port holds")
    parser.add_argument("--max-connections-per-client", type=int, default=64,
                        help="connections one client address may hold on the API port")
    args = parser.parse_args(list(argv))
    if min(args.max_held, args.max_body_bytes, args.max_connections, args.max_connections_per_client) < 1 \
            or not 0 < args.hold_seconds <= 3600:
        parser.error("--max-held, --hold-seconds (at most 3600), --max-body-bytes and the connection bounds must be "
                     "positive")
    if not args.backend.startswith(("http://", "https://")):
        parser.error("--backend must be an http(s) URL")
    return ActivatorSettings(service=args.service, backend=args.backend.rstrip("/"), port=args.port,
                             metrics_port=args.metrics_port, host=args.host, max_held=args.max_held,
                             hold_seconds=args.hold_seconds, max_body_bytes=args.max_body_bytes,
                             picker_model=args.served_model_name if args.model_server_metrics else None,
                             max_connections=args.max_connections,
                             max_connections_per_client=args.max_connections_per_client)


def main(argv: Sequence[str]) -> None:
    import uvicorn

    settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sockets = [_listen(settings.host, settings.port), _listen(settings.host, settings.metrics_port)]
    # The runtime's bounds on what reaches the app: heads and bodies in time and size, connections per port and
    # per client address (never authenticated here, so the per-address bound holds for a connection's life)
    connections = Connections({settings.port: settings.max_connections, settings.metrics_port: METRICS_CONNECTIONS},
                              settings.max_connections, settings.max_connections_per_client,
                              authenticated_ports=frozenset({settings.port}))
    protocol = bounded_protocol(MAX_HEAD_BYTES, HEAD_SECONDS, BODY_SECONDS, connections)
    activator = Activator(settings)
    config = uvicorn.Config(activator, log_level="warning", access_log=False, lifespan="on", http=protocol,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS, timeout_graceful_shutdown=5)
    log.info("Activator for %s: holding up to %d requests for %gs, forwarding to %s", settings.service,
             settings.max_held, settings.hold_seconds, settings.backend)
    server = uvicorn.Server(config)
    handle_exit = server.handle_exit

    def stop_then_exit(sig: int, frame: Any) -> None:
        """SIGTERM: the held requests get their 503 now, inside uvicorn's graceful window (they were cut off
        at its end, a 500 to the client), then uvicorn stops as usual."""
        if activator.loop is not None and not activator.loop.is_closed():
            activator.loop.call_soon_threadsafe(activator.stop)
        handle_exit(sig, frame)

    server.handle_exit = stop_then_exit  # type: ignore[method-assign]
    server.run(sockets=sockets)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    sock.listen(1024)
    return sock
