"""GET /metrics: Prometheus text exposition of this process's series."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tally_runtime.metrics import sglang_series
from tally_runtime.serving import Server

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server: Server = request.app.state.server
    server.metrics.engine_healthy.set(1 if server.engine.health().ok else 0)
    engine_text = sglang_series() if server.info.engine_kind.startswith("sglang") else b""
    body = server.metrics.render(engine_text, settled=server.admission.idle)
    request.app.state.drain.metrics_read()
    return Response(body, media_type=CONTENT_TYPE_LATEST)
