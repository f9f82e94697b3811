"""GET /metrics: Prometheus text exposition of this process's series; POST /internal/final-read: the
operator's acknowledgement that it booked the final counters of a draining runtime (drain.py)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tally_runtime import contract
from tally_runtime.protocol import ApiError
from tally_runtime.respond import error_response, json_response, read_body
from tally_runtime.serving import Server

router = APIRouter()
MAX_ACK_BYTES = 4096


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server: Server = request.app.state.server
    body = server.metrics.render(server.engine.own_metrics(), settled=server.done)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.post(contract.FINAL_READ_PATH)
async def final_read(request: Request) -> Response:
    body = await read_body(request, MAX_ACK_BYTES)  # bounded before it is read: 413 past it
    try:
        acknowledged = orjson.loads(body)
    except orjson.JSONDecodeError:
        acknowledged = None
    if not isinstance(acknowledged, dict):
        return error_response(ApiError(400, "Expected a JSON object of the counters that were booked"))
    if not request.app.state.drain.acknowledge(acknowledged):
        return error_response(ApiError(409, "Not draining and idle, or these are not the final counters",
                                       code="not_final"))
    return json_response({"status": "acknowledged"})
