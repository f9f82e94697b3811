"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tally_runtime.prepare import CHAT, Job
from tally_runtime.protocol import ChatCompletionRequest
from tally_runtime.respond import read_request, respond
from tally_runtime.serving import Server

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    server: Server = request.app.state.server

    async def prepare() -> Job:
        return await server.prepare.chat(await read_request(request, ChatCompletionRequest))

    return await respond(request, server, CHAT, prepare)
