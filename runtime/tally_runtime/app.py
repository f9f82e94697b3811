"""create_app(settings, engine): the lifespan owns the engine; routers and error handlers are wired here.

With `--metrics-port`, one app listens on two ports and `OnlyItsPort` keeps them apart: /metrics and the
final-read handshake answer on the metrics port only (which only the operator should reach), the API on
the API port only; /health answers on both."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tally_runtime import contract, handoff, pool_metrics
from tally_runtime.auth import ApiKeys
from tally_runtime.budgets import Budgets
from tally_runtime.client_watch import StallGuard
from tally_runtime.collect import Collection
from tally_runtime.delivery import Delivery
from tally_runtime.drain import Drain
from tally_runtime.engine.base import Engine
from tally_runtime.fastlane import TallyApp, lanes
from tally_runtime.http_limits import Connections
from tally_runtime.ledger import Journal, Totals
from tally_runtime.metrics import Metrics
from tally_runtime.protocol import ApiError
from tally_runtime.records import RecordSink
from tally_runtime.respond import error_response
from tally_runtime.routes import chat, completions, health, metrics, models, responses
from tally_runtime.serving import Server
from tally_runtime.settings import Settings
from tally_runtime.units import COUNTS

log = logging.getLogger("tally_runtime")


def counted(totals: Totals, tenant: str, server: Server) -> float:
    """The tenant's counter on this pod as its budget counts it (what the operator books from /metrics)."""
    _, prompt, completion, cached = totals.tenants.get(tenant, (0.0, 0.0, 0.0, 0.0))
    weights = server.budgets.weights if server.budgets is not None else COUNTS["total"]
    return weights.of(prompt, cached, completion)


def create_app(settings: Settings, engine: Engine, exit_now: Callable[[], None] | None = None,
               connections: Connections | None = None) -> FastAPI:
    """`exit_now` ends the HTTP server (uvicorn's `should_exit`); given, the app drains on SIGTERM.
    `connections` are the server's (http_limits.py): a drain closes them after their responses."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = time.monotonic()
        info = await engine.start()
        journal = Journal(Path(settings.journal_path)) if settings.journal_path else None
        totals = journal.resume() if journal is not None else Totals()
        metrics_ = Metrics(engine_offset=(info.probe_prompt_tokens, info.probe_completion_tokens),
                           totals=totals, max_tenants=settings.max_tenants, pod_uid=settings.pod_uid)
        delivery = start_delivery(settings, metrics_)
        app.state.collection = delivery if isinstance(delivery, Collection) else None
        records = RecordSink(settings.usage_records, settings.usage_records_file, cloudevents_source(settings),
                             on_lost=lambda sink: metrics_.records_lost.labels(sink).inc(),
                             deliver=delivery.append if delivery is not None else None,
                             delivery_source=settings.usage_source) \
            if settings.usage_records or settings.usage_records_file or delivery is not None else None
        app.state.stall_guard.on_end = metrics_.streams_stalled.inc
        if connections is not None:
            connections.on_refused = lambda why: metrics_.connections_refused.labels(why).inc()
        if totals.requests:
            log.info("Usage counters continue from %s (%d requests so far)", settings.journal_path,
                     sum(totals.requests.values()))
        if journal is not None:
            metrics_.journal_healthy.set_function(lambda: 1.0 if journal.healthy else 0.0)
        metrics_.set_stream_mode(str(info.stream_mode))
        metrics_.engine_healthy.set_function(lambda: 1.0 if engine.health().ok else 0.0)
        app.state.started = int(time.time())
        server = Server(
            engine, info, settings.served_model_name, metrics_, settings.max_concurrent_generations,
            force_include_usage=settings.force_include_usage, max_queued=settings.max_queued_requests,
            max_queue_seconds=settings.max_queue_seconds, journal=journal, records=records,
        )
        app.state.tenant_header = settings.tenant_header
        app.state.max_body_bytes = settings.max_body_bytes
        app.state.server = server
        server.service = (settings.service_namespace, settings.service_name)
        if settings.budgets:
            refusals = metrics_.budget_refusals
            server.budgets = Budgets(counter=lambda tenant: counted(totals, tenant, server), epoch=totals.epoch,
                                     on_refused=lambda tenant, code: refusals.labels(tenant, code).inc())
        app.state.drain = Drain(server, settings.drain_seconds, settings.final_read_seconds, exit_now or _no_exit,
                                connections, delivery)
        if exit_now is not None:
            app.state.drain.install()  # after engine.start(): SGLang installed its own handler by then
        log.info("Engine %s ready in %.1fs serving %r (context %d, %s streaming)", info.engine_kind,
                 time.monotonic() - started, settings.served_model_name, info.context_length, info.stream_mode)
        try:
            yield
        finally:
            await server.settle()
            await engine.stop()
            if records is not None:
                records.close()
            if delivery is not None:
                await delivery.close()
            if journal is not None:
                journal.close()

    app = TallyApp(title="Tally runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    for module in (completions, chat, responses, models, health, metrics):
        app.include_router(module.router)
    app.lanes = lanes(completions.router, chat.router, responses.router)
    app.metrics_port = settings.metrics_port
    # Read now, so that a keys file that cannot be used stops the runtime before it serves anything.
    app.state.api_keys = ApiKeys(Path(settings.api_keys_file)) if settings.api_keys_file else None
    app.state.trust_tenant_header = settings.trust_tenant_header or app.state.api_keys is None
    app.state.stall_guard = StallGuard(settings.send_stall_seconds)
    app.state.final_read_key = handoff.public_key(settings.final_read_key) if settings.final_read_key else None
    if settings.metrics_port:
        def picker_gauges() -> bytes:
            server: Server = app.state.server
            return pool_metrics.render(settings.served_model_name, server.admission.queued, server.admission.used,
                                       server.engine.cache_load())

        app.add_middleware(OnlyItsPort, metrics_port=settings.metrics_port,
                           picker_gauges=picker_gauges if settings.model_server_metrics else None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> Response:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> Response:
        return error_response(ApiError(400, str(error)))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> Response:
        return error_response(ApiError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> Response:
        log.error("Unhandled error: %r", error)
        return error_response(ApiError(500, "Internal server error"))

    return app


MAX_TOKEN_BYTES = 4096  # a bearer token; a larger file is read no further


def start_delivery(settings: Settings, metrics_: Metrics) -> Delivery | Collection | None:
    """The records' delivery to --usage-records-url, or kept for the operator to collect (--usage-records-pull);
    the spool next to the journal unless named."""
    if not settings.usage_records_url and not settings.usage_records_pull:
        return None
    spool = Path(settings.usage_records_spool or Path(settings.journal_path).parent / "usage-records.spool")
    if settings.usage_records_pull:
        collection = Collection(spool, settings.usage_records_spool_bytes,
                                on_lost=lambda count: metrics_.records_lost.labels("delivery").inc(count),
                                on_refused=metrics_.records_refused.inc, on_collected=metrics_.records_delivered.inc)
        metrics_.records_oldest.set_function(collection.spool.oldest_age)
        metrics_.records_queued.set_function(lambda: float(collection.pending))
        return collection
    token = ""
    if settings.usage_records_token_file:
        with Path(settings.usage_records_token_file).open("rb") as f:
            token = f.read(MAX_TOKEN_BYTES).decode("utf-8", "replace").strip()
    delivery = Delivery(settings.usage_records_url, spool, token, settings.usage_records_spool_bytes,
                        on_lost=lambda count: metrics_.records_lost.labels("delivery").inc(count),
                        on_delivered=metrics_.records_delivered.inc, ca_file=settings.usage_records_ca_file,
                        proxy=settings.usage_records_proxy, ca_pem=settings.usage_records_ca)
    metrics_.records_oldest.set_function(delivery.spool.oldest_age)
    metrics_.records_queued.set_function(lambda: float(delivery.pending))
    if delivery.pending:
        log.info("%d usage record(s) from before a restart are still to be delivered", delivery.pending)
    delivery.start()
    return delivery


def cloudevents_source(settings: Settings) -> str:
    """The records' CloudEvents source when they are written as CloudEvents; empty for plain records."""
    if settings.usage_records_format != "cloudevents":
        return ""
    return settings.usage_source or f"tally-runtime/{socket.gethostname()}"


def _no_exit() -> None:
    log.warning("Drained, but this app was given no way to stop its server")


METRICS_PATHS = frozenset({"/metrics", contract.FINAL_READ_PATH, contract.BUDGETS_PATH, contract.BUDGET_ASKS_PATH,
                           contract.RECORDS_PATH, contract.RECORDS_ACK_PATH})


BOTH_PORTS = frozenset({"/health", contract.READY_PATH})


class OnlyItsPort:
    """Each path on its own port: the metrics port serves /metrics, the handshake and /health; the API port
    everything else. A request on the wrong port is a 404, as for a path that does not exist. With
    `picker_gauges`, the API port's GET /metrics is the model-server protocol's gauges alone."""

    def __init__(self, app: ASGIApp, metrics_port: int, picker_gauges: Callable[[], bytes] | None = None) -> None:
        self.app = app
        self.metrics_port = metrics_port
        self.picker_gauges = picker_gauges

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            on_metrics_port = (scope.get("server") or (None, None))[1] == self.metrics_port
            path = scope["path"]
            if path == "/metrics" and not on_metrics_port and self.picker_gauges and scope["method"] == "GET":
                body = self.picker_gauges()
                headers = [(b"content-type", pool_metrics.CONTENT_TYPE.encode()),
                           (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            if path not in BOTH_PORTS and (path in METRICS_PATHS) != on_metrics_port:
                await error_response(ApiError(404, f"Not found: {path}"))(scope, receive, send)
                return
        await self.app(scope, receive, send)
