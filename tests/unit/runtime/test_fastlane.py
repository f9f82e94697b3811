"""The fast lane: POSTs to a lane's path reach its handler without FastAPI's router; everything else, and
every path on the metrics port, goes through FastAPI as before; a handler's failure is an OpenAI error."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response
from starlette.testclient import TestClient

from tally_runtime.app import OnlyItsPort
from tally_runtime.fastlane import TallyApp
from tally_runtime.protocol import ApiError
from tally_runtime.respond import json_response


def app_with_lane(metrics_port: int = 0) -> tuple[TallyApp, list[str]]:
    app = TallyApp()
    seen: list[str] = []

    async def lane(request: Request) -> Response:
        seen.append(request.app.state.marker)  # the handler sees the app, as a routed one does
        body = await request.json()
        if body.get("fail") == "api":
            raise ApiError(429, "slow down", code="rate_limit_exceeded")
        if body.get("fail") == "bug":
            raise RuntimeError("a bug")
        return json_response({"lane": True})

    @app.post("/routed")
    async def routed() -> dict[str, Any]:
        return {"lane": False}

    app.state.marker = "app"
    app.lanes = {"/v1/completions": lane}  # only in the lane: no route of FastAPI's serves it
    if metrics_port:
        app.metrics_port = metrics_port
        app.add_middleware(OnlyItsPort, metrics_port=metrics_port)
    return app, seen


def test_a_lane_is_served_without_a_route_and_other_requests_go_through_fastapi() -> None:
    app, seen = app_with_lane()
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={}).json() == {"lane": True}
        assert seen == ["app"]
        assert client.post("/routed").json() == {"lane": False}
        assert client.get("/v1/completions").status_code == 404  # not a POST: FastAPI's answer (no route)
        assert seen == ["app"]


def test_a_handlers_failure_is_an_openai_error() -> None:
    app, _ = app_with_lane()
    with TestClient(app, raise_server_exceptions=False) as client:
        refused = client.post("/v1/completions", json={"fail": "api"})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        failed = client.post("/v1/completions", json={"fail": "bug"})
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == "Internal server error"  # no trace of the bug's words


def test_the_metrics_port_refuses_a_lanes_path() -> None:
    app, seen = app_with_lane(metrics_port=9090)
    sent: list[dict[str, Any]] = []

    async def post(port: int) -> int:
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "server": ("127.0.0.1", port), "query_string": b"", "root_path": "", "scheme": "http",
                 "http_version": "1.1", "client": ("127.0.0.1", 1)}
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return int(sent[-2]["status"]) if sent[-2]["type"] == "http.response.start" else 0

    assert asyncio.run(post(9090)) == 404
    assert seen == []
    assert asyncio.run(post(8000)) == 200
    assert seen == ["app"]


def test_the_runtime_takes_every_generation_route_in_its_lane() -> None:
    """Without this a lane that lost a path would still answer (through FastAPI), only slower."""
    from tally_runtime.app import create_app
    from tally_runtime.engine.base import Engine
    from tally_runtime.routes import chat, completions, responses
    from tally_runtime.settings import Settings

    app = create_app(Settings(), cast(Engine, None))  # the engine is first used by the lifespan, not run here
    assert isinstance(app, TallyApp)
    assert dict(app.lanes) == {"/v1/completions": completions.create_completion,
                               "/v1/chat/completions": chat.create_chat_completion,
                               "/v1/responses": responses.create_response}
