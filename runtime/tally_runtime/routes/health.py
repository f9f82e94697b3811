"""GET /health: 200 only when the engine can generate; 503 with the reason otherwise. GET /ready: the same, and
with budgets only once the first lease has come (the readiness probe). Neither generates."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tally_runtime.contract import READY_PATH
from tally_runtime.respond import json_response
from tally_runtime.serving import Server

router = APIRouter()


@router.get(READY_PATH)
async def ready(request: Request) -> Response:
    """The readiness probe: /health's answer, and with budgets not before the operator's first lease (a pod
    that could only make its clients wait for one should not be in its Service yet)."""
    answer = await health(request)
    server: Server | None = getattr(request.app.state, "server", None)
    if answer.status_code == 200 and server is not None and server.budgets is not None and not server.budgets.leased:
        return json_response({"status": "unready", "reason": "waiting for the operator's first budget lease"}, 503)
    return answer


@router.get("/health")
async def health(request: Request) -> Response:
    server: Server | None = getattr(request.app.state, "server", None)
    if server is None:
        return json_response({"status": "starting"}, 503)
    state = server.engine.health()
    if server.draining:
        return json_response({"status": "draining", "reason": "the server is shutting down"}, 503)
    keys = request.app.state.api_keys
    if keys is not None:
        keys.maybe_reload()
        if keys.problem:  # revoked, fail closed: every request would be a 401, so take no traffic
            return json_response({"status": "unhealthy", "reason": keys.problem}, 503)
    if state.ok:
        return json_response({"status": "ok"})
    return json_response({"status": "unhealthy", "reason": state.reason}, 503)
