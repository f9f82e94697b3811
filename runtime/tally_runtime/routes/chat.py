"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tally_runtime.prepare import CHAT, Job
from tally_runtime.protocol import ChatCompletionRequest, parse_json_body, validated
from tally_runtime.respond import read_body, respond
from tally_runtime.serving import Server

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    server: Server = request.app.state.server

    async def prepare() -> Job:
        raw = await read_body(request, request.app.state.max_body_bytes)
        body = parse_json_body(raw, request.headers.get("content-type"))
        return await server.prepare.chat(validated(ChatCompletionRequest, body))

    return await respond(request, server, CHAT, prepare)
