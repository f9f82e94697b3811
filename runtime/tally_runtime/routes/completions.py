"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tally_runtime.prepare import COMPLETIONS, Job
from tally_runtime.protocol import CompletionRequest
from tally_runtime.respond import read_request, respond
from tally_runtime.serving import Server

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    server: Server = request.app.state.server

    async def prepare() -> Job:
        return await server.prepare.completion(await read_request(request, CompletionRequest))

    return await respond(request, server, COMPLETIONS, prepare)
