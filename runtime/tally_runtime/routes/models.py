"""GET /v1/models and /v1/models/{id}: the one served model, with `root` and `max_model_len`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tally_runtime.protocol import ApiError
from tally_runtime.respond import authenticated, error_response, json_response
from tally_runtime.serving import Server

router = APIRouter()


def model_card(server: Server, created: int) -> dict[str, Any]:
    return {
        "id": server.model,
        "object": "model",
        "created": created,
        "owned_by": "tally",
        "root": server.model,  # the served name: where the weights lie on the pod is not a client's business
        "parent": None,
        "max_model_len": server.info.context_length,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    server: Server = request.app.state.server
    authenticated(request)  # as OpenAI's: a key is needed when keys are on
    return json_response({"object": "list", "data": [model_card(server, request.app.state.started)]})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    server: Server = request.app.state.server
    authenticated(request)
    if model_id != server.model:
        return error_response(
            ApiError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        )
    return json_response(model_card(server, request.app.state.started))
