"""The shared request flow: prepare (4xx before any byte), admit and prime, then stream or answer.

From the moment the body is read until the response starts, a watcher cancels the request if the
client leaves: a request waiting in the admission queue or in prefill is dropped, not run for nobody.

Every request that reaches a route is recorded exactly once, whatever happens: here when it is refused
or fails before it is admitted (a client that leaves while sending its body included), by the server
once it is admitted (serving.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from tally_runtime import contract, sse
from tally_runtime.prepare import Endpoint, Job
from tally_runtime.protocol import ApiError
from tally_runtime.records import tenant_of
from tally_runtime.serving import Server

T = TypeVar("T")
log = logging.getLogger("tally_runtime.respond")

CLIENT_CLOSED = 499  # nginx's convention; the client never sees it


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), error.status, error.headers)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, headers=headers, media_type="application/json")


async def respond(request: Request, server: Server, endpoint: Endpoint,
                  prepare: Callable[[], Awaitable[Job]]) -> Response:
    header = request.headers.get(request.app.state.tenant_header) if request.app.state.tenant_header else None
    job: Job | None = None
    started = time.monotonic()
    try:
        job = await prepare()
        run = await until_disconnected(request, server.start(job, tenant_of(header, job.user), started))
    except ApiError as error:
        server.reject(endpoint.name, error, tenant_or_none(header, job), job)
        return error_response(error)
    except ClientGone:  # left while queued or in prefill: the server recorded it
        return Response(status_code=CLIENT_CLOSED)
    except ClientDisconnect:  # left while sending its body: nothing was prepared
        server.abandon(endpoint.name, contract.OUTCOME_ABORTED, tenant_or_none(header, None), None, started)
        return Response(status_code=CLIENT_CLOSED)
    except Exception:
        log.exception("Request to %s failed before it was admitted", endpoint.name)
        server.fail(endpoint.name, tenant_or_none(header, job), started)
        return error_response(ApiError(500, "Internal error while preparing the request"))
    if job.stream:
        return StreamingResponse(run.stream(), media_type=sse.MEDIA_TYPE, headers=sse.STREAM_HEADERS)
    try:
        payload = await until_disconnected(request, run.collect())
    except ApiError as error:
        return error_response(error)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return json_response(payload)


def tenant_or_none(header: str | None, job: Job | None) -> str:
    """The tenant a refused request is recorded under; one whose tenant is itself refused is anonymous."""
    try:
        return tenant_of(header, job.user if job else None)
    except ApiError:
        return tenant_of(None, None)


class ClientGone(Exception):
    pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so aborting the engine) if the client leaves.

    Starlette cancels streaming bodies on disconnect by itself; everything before a response starts,
    and plain responses, need this watcher.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone.is_set():
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()
