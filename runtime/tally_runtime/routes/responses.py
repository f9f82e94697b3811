"""POST /v1/responses: the Responses API over the chat serving core (responses_api.py), and GET/DELETE of a
stored response, which this server never has (it stores none)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tally_runtime import responses_api
from tally_runtime.prepare import Endpoint, Job
from tally_runtime.protocol import ApiError, ChatCompletionRequest
from tally_runtime.respond import error_response, read_request, respond
from tally_runtime.responses_render import ResponsesRenderer
from tally_runtime.serving import Server
from tally_runtime.streaming import ChatChunks

router = APIRouter()
RESPONSES = Endpoint("responses", "resp", ChatChunks, responses_api.responses_response, opens_with_role=False,
                     renderer=ResponsesRenderer)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    server: Server = request.app.state.server

    async def prepare() -> Job:
        req = await read_request(request, responses_api.ResponsesRequest)
        chat = responses_api.to_chat(req)
        try:
            job = await server.prepare.chat(chat)
        except ApiError as error:
            if req.truncation != "auto" or error.code != "context_length_exceeded":
                raise responses_api.renamed(error) from None
            job = await fitted(server, chat, error)
        return dataclasses.replace(job, endpoint=RESPONSES, header=responses_api.header(req, job.header))

    return await respond(request, server, RESPONSES, prepare)


async def fitted(server: Server, chat: ChatCompletionRequest, error: ApiError) -> Job:
    """`truncation: auto`: the conversation without as few of its oldest turns as make it fit the context (a
    binary search: each try renders and counts the prompt again); the refusal if even its last turn does not."""

    async def without(drop: int) -> Job | None:
        try:
            return await server.prepare.chat(responses_api.truncated(chat, drop))
        except ApiError as refused:
            if refused.code != "context_length_exceeded":
                raise responses_api.renamed(refused) from None
            return None

    low, high = 0, len(responses_api.turns(chat)) - 1  # dropping `low` turns does not fit; `high` must
    best = await without(high) if high > 0 else None
    if best is None:
        raise responses_api.renamed(error) from None
    while high - low > 1:
        middle = (low + high) // 2
        job = await without(middle)
        if job is None:
            low = middle
        else:
            best, high = job, middle
    return best


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
@router.get("/v1/responses/{response_id}/input_items")
async def stored_response(response_id: str) -> Response:
    return error_response(ApiError(404, f"No response with id {response_id[:64]!r}: this server stores no "
                                        "responses (every one is store: false)", param="response_id",
                                   code="not_found"))
