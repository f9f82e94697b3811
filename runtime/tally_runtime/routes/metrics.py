"""GET /metrics: Prometheus text exposition of this process's series."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tally_runtime.serving import Server

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server: Server = request.app.state.server
    body = server.metrics.render(server.engine.own_metrics(), settled=server.admission.idle)
    request.app.state.drain.metrics_read()
    return Response(body, media_type=CONTENT_TYPE_LATEST)
