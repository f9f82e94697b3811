"""The generation routes (completions, chat, responses), served without FastAPI's per-request machinery.

A short streaming request spent about a third of the server's CPU in FastAPI and Starlette before and
around Tally's own code: five middlewares, the router's matching, dependency solving (which parses the
query string the routes never read) and an exit stack (benchmarks/README.md, the burst profile). The
generation routes need none of it: each takes a `Request` and answers every error itself (respond.py). So
`TallyApp` hands a POST to any of these paths straight to its handler and everything else (other paths and
methods, the lifespan, any path on the metrics port) to FastAPI as before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from tally_runtime.protocol import ApiError
from tally_runtime.respond import error_response

log = logging.getLogger("tally_runtime")

Handler = Callable[[Request], Awaitable[Response]]


class TallyApp(FastAPI):
    """FastAPI with a fast lane: `lanes` maps a path to the handler of its POST requests."""

    lanes: Mapping[str, Handler] = {}
    metrics_port: int = 0  # requests on it go through FastAPI, where OnlyItsPort refuses API paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.lanes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None or (self.metrics_port and (scope.get("server") or (None, None))[1] == self.metrics_port):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # what Starlette sets: the handlers read `request.app.state`
        try:
            response = await handler(Request(scope, receive, send))
        except ApiError as error:
            response = error_response(error)
        except Exception as error:  # what FastAPI's last exception handler does for the other routes
            log.error("Unhandled error: %r", error)
            response = error_response(ApiError(500, "Internal server error"))
        await response(scope, receive, send)


def lanes(*routers: APIRouter) -> dict[str, Handler]:
    """The POST routes of these routers, by path: each route's own handler, so a path is written once."""
    return {route.path: route.endpoint for router in routers for route in router.routes
            if isinstance(route, APIRoute) and route.methods == {"POST"}}
