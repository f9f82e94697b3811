"""The shared request flow: prepare (4xx before any byte), admit and prime, then stream or answer.

From the moment the body is read until the last byte, a watcher cancels the request if the client
leaves (client_watch.py): a request waiting in the admission queue or in prefill is dropped, not run for
nobody, and a stream ends at once.

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
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from tally_runtime import auth, contract, sse
from tally_runtime.client_watch import ClientGone, ClientWatch, EventStreamResponse
from tally_runtime.http_limits import AUTHENTICATED
from tally_runtime.prepare import Endpoint, Job
from tally_runtime.protocol import ApiError, parse_json_body, validated
from tally_runtime.serving import Server

log = logging.getLogger("tally_runtime.respond")

CLIENT_CLOSED = 499  # nginx's convention; the client never sees it
M = TypeVar("M", bound=BaseModel)


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), error.status, error.headers)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, headers=headers, media_type="application/json")


async def respond(request: Request, server: Server, endpoint: Endpoint,
                  prepare: Callable[[], Awaitable[Job]]) -> Response:
    state = request.app.state
    header_name: str = state.tenant_header
    headers = request.headers.getlist(header_name) if header_name else []
    job: Job | None = None
    # Who is billed, as far as it is known: a refusal is recorded under it (the key's or the header's tenant
    # before the body is read, the `user` field's after); a client never makes a refusal count as another's.
    tenant = auth.Tenant(auth.NO_TENANT, auth.SOURCE_NONE)
    started = time.monotonic()
    try:
        keyed = authenticated(request)
        tenant = auth.resolve(keyed, headers, state.trust_tenant_header, header_name, None)
        job = await prepare()
        tenant = auth.resolve(keyed, headers, state.trust_tenant_header, header_name, job.user)
        watch = ClientWatch(request.receive).start()  # the body is read: from here, a disconnect is the end
        try:
            async with watch:
                run = await server.start(job, tenant, started)
        except BaseException:
            watch.stop()
            raise
        # Whatever happens to this task from here (the response sent, or the task ended before it could
        # start), the run's books close: the slots go back and the request is recorded.
        asyncio.current_task().add_done_callback(run.close_soon)  # type: ignore[union-attr]
    except ApiError as error:
        if not error.recorded:
            server.reject(endpoint.name, error, error.tenant if isinstance(error, TooManyConnections) else tenant,
                          job)
        return error_response(error)
    except ClientGone:  # left while queued or in prefill, or while its refusal closed: the server recorded it
        return Response(status_code=CLIENT_CLOSED)
    except ClientDisconnect:  # left while sending its body: nothing was prepared
        server.abandon(endpoint.name, contract.OUTCOME_ABORTED, tenant, None, started)
        return Response(status_code=CLIENT_CLOSED)
    except Exception:
        log.exception("Request to %s failed before it was admitted", endpoint.name)
        server.fail(endpoint.name, tenant, started)
        return error_response(ApiError(500, "Internal error while preparing the request"))
    if job.stream:
        return EventStreamResponse(run.stream(), watch, sse.MEDIA_TYPE, sse.STREAM_HEADERS, state.stall_guard)
    try:
        async with watch:
            payload = await run.collect()
    except ApiError as error:
        return error_response(error)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        watch.stop()
    return json_response(payload)


def authenticated(request: Request) -> auth.Key | None:
    """The request's key (None without keys); a valid one lifts its connection's pre-authentication bound and
    counts the connection as its key's tenant's: 429 (recorded as that tenant's; the connection closes) when
    the tenant holds its share of the server's connections already."""
    keyed = auth.authenticate(request.app.state.api_keys, request.headers.getlist("authorization"))
    if keyed is not None and (mark := request.scope.get(AUTHENTICATED)) is not None and not mark(keyed.tenant):
        raise TooManyConnections(keyed)
    return keyed


class TooManyConnections(ApiError):
    def __init__(self, keyed: auth.Key) -> None:
        super().__init__(429, "This API key's tenant holds as many connections to this server as it may; reuse "
                              "one or close some", code="rate_limit_exceeded", headers=auth.UNAUTHENTICATED_HEADERS)
        self.tenant = auth.Tenant(keyed.tenant, auth.SOURCE_KEY)


# Bodies larger than this are parsed and validated on the preparer's one worker thread: 7 MiB bodies took
# seconds of the event loop (four at once stalled /health past the kubelet's probe timeout). The GIL is still
# shared, but the loop gets its turns every switch interval, against one thread at most.
INLINE_PARSE_BYTES = 256 << 10


async def read_request(request: Request, model: type[M]) -> M:
    """The request body, bounded in size (413 before it is read whole), parsed as JSON, counted (what can be
    refused on its counts is refused before it is validated) and validated."""
    raw = await read_body(request, request.app.state.max_body_bytes)
    content_type = request.headers.get("content-type")
    server = request.app.state.server
    limit = server.info.context_length

    def parse() -> M:
        body = parse_json_body(raw, content_type)
        if isinstance(body, dict):
            refuse_by_count(body, limit)
        return validated(model, body)

    if len(raw) <= INLINE_PARSE_BYTES:
        return parse()
    return await asyncio.get_running_loop().run_in_executor(server.prepare.worker, parse)


def refuse_by_count(body: dict[str, Any], context_length: int) -> None:
    """More messages, prompt items or Responses input items than the context has tokens never fit: refused
    before validation, which costs per item (every chat template writes at least a token per message; a list
    of prompts or of token ids longer than the context is too many of either)."""
    for param in ("messages", "prompt", "input"):
        items = body.get(param)
        if isinstance(items, list) and len(items) > context_length:
            raise ApiError(400, f"{len(items)} items in {param} cannot fit the model's context of "
                                f"{context_length} tokens", param=param, code="context_length_exceeded")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to be larger than `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"The request body is larger than the server accepts ({limit} bytes)",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"The request body is larger than the server accepts ({limit} bytes)",
                           code="request_too_large")
    return bytes(body)
