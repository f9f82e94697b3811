"""GET /metrics: Prometheus text exposition of this process's series; POST /internal/final-read: the
operator's acknowledgement that it booked the final counters of a draining runtime (drain.py), signed by
the operator (handoff.py) when the runtime was given its key."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tally_runtime import contract, handoff
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
    key = request.app.state.final_read_key
    if key is not None and not handoff.verify(key, body, request.headers.get(handoff.SIGNATURE_HEADER)):
        return error_response(ApiError(403, "The acknowledgement is not signed by this pod's operator",
                                       code="forbidden"))
    try:
        acknowledged = orjson.loads(body)
    except orjson.JSONDecodeError:
        acknowledged = None
    if not isinstance(acknowledged, dict):
        return error_response(ApiError(400, "Expected a JSON object of the counters that were booked"))
    pod_uid = request.app.state.server.metrics.pod_uid
    if key is not None and pod_uid and acknowledged.get("podUid") != pod_uid:
        return error_response(ApiError(403, "The acknowledgement names another pod", code="forbidden"))
    if acknowledged.get("release") is True:
        request.app.state.drain.release()
        return json_response({"status": "released"})
    if not request.app.state.drain.acknowledge(acknowledged):
        return error_response(ApiError(409, "Not draining and idle, or these are not the final counters",
                                       code="not_final"))
    return json_response({"status": "acknowledged"})
