"""create_app(settings, engine): the lifespan owns the engine; routers and error handlers are wired here."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from tally_runtime.drain import Drain
from tally_runtime.engine.base import Engine
from tally_runtime.ledger import Journal, Totals
from tally_runtime.metrics import Metrics
from tally_runtime.protocol import ApiError
from tally_runtime.records import RecordSink
from tally_runtime.respond import error_response
from tally_runtime.routes import chat, completions, health, metrics, models
from tally_runtime.serving import Server
from tally_runtime.settings import Settings

log = logging.getLogger("tally_runtime")


def create_app(settings: Settings, engine: Engine, exit_now: Callable[[], None] | None = None) -> FastAPI:
    """`exit_now` ends the HTTP server (uvicorn's `should_exit`); given, the app drains on SIGTERM."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = time.monotonic()
        info = await engine.start()
        journal = Journal(Path(settings.journal_path)) if settings.journal_path else None
        resumed = journal.load() if journal is not None else None
        metrics_ = Metrics(engine_offset=(info.probe_prompt_tokens, info.probe_completion_tokens),
                           totals=resumed or Totals(), max_tenants=settings.max_tenants, pod_uid=settings.pod_uid)
        records = RecordSink(settings.usage_records, settings.usage_records_file) \
            if settings.usage_records or settings.usage_records_file else None
        if resumed is not None:
            log.info("Usage counters continue from %s (%d requests so far)", settings.journal_path,
                     sum(resumed.requests.values()))
        if journal is not None:  # at once: a restart before the first request keeps this epoch
            journal.write(metrics_.totals)
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
        app.state.server = server
        app.state.drain = Drain(server, settings.drain_seconds, settings.final_read_seconds, exit_now or _no_exit)
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
            if journal is not None:
                journal.close()

    app = FastAPI(title="Tally runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    for module in (completions, chat, models, health, metrics):
        app.include_router(module.router)

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


def _no_exit() -> None:
    log.warning("Drained, but this app was given no way to stop its server")
