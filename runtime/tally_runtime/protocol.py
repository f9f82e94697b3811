"""OpenAI wire models for requests, named as the OpenAI API names them, and the error envelope.

Requests are validated here before the first byte is sent; every rejection is an `ApiError`
that names the offending parameter. Response chunks are plain dicts built in `streaming.py`
(cheaper than models on the hot path).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_SEQUENCES = 4

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """An error response in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type(status)
        self.headers = headers or {}
        self.recorded = False  # the request it refused is recorded already (serving.Server.start)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def error_type(status: int) -> str:
    """The OpenAI error type of a status."""
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_SCHEMA_BYTES = 64 << 10  # a response_format schema, as JSON: compiled into a grammar per request


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output is constrained to (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        text = orjson.dumps(self.json_schema.schema_ or {}).decode()
        if len(text) > MAX_SCHEMA_BYTES:
            raise ValueError(f"the schema is {len(text)} bytes as JSON; at most {MAX_SCHEMA_BYTES} are accepted")
        return text


def null_is_omitted(model: type[BaseModel], data: Any) -> Any:
    """A request's `null` for a field that has a default reads as the field left out, as the OpenAI API takes it
    (`temperature: null`, `top_p: null`, `parallel_tool_calls: null` were 400s); a required field stays required."""
    if not isinstance(data, dict) or None not in data.values():
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat. Unknown fields are accepted (benchmark clients send them)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        return null_is_omitted(cls, data)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_disabled_or_positive(cls, value: int) -> int:
        # SGLang's SamplingParams.verify refuses 0 after the first byte would have been sent.
        if value == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(value)}")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's function names; call ids are held to the same characters
MAX_TOOLS = 128
CALL_ID = r"^[A-Za-z0-9_.:-]{1,128}$"  # a tool call's id, as it comes back in the history


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=NAME)
    arguments: str = Field(max_length=MAX_SCHEMA_BYTES)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(pattern=CALL_ID)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=NAME)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, pattern=CALL_ID)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1)  # the Responses API's bound on calls (an extension on chat)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(400, f"Content-Type must be application/json, not {media or 'missing'!r}")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise ApiError(400, f"The request body is not valid JSON: {err}") from None


def validated(model: type[M], body: Any) -> M:
    """Validate a parsed body, turning the first pydantic error into a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"] if not _is_union_branch(part)]
        param = ".".join(loc) or None
        message = first["msg"]
        if first["type"] == "missing":
            message = f"Missing required parameter: {param!r}"
        elif param:
            message = f"Invalid value for {param!r}: {message}"
        raise ApiError(400, message, param=param, code="invalid_value") from None


def _is_union_branch(part: object) -> bool:
    # pydantic puts the tried union member ("str", "list[int]", ...) into the location
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "none"})
