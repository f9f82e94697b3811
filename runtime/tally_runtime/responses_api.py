"""PURE: the Responses API (`POST /v1/responses`) as a wire format over the chat serving core.

A Responses request is translated into a chat request (`to_chat`): `instructions` and the input items become
messages (a `function_call` item an assistant message's tool call, a `function_call_output` a tool message),
`max_output_tokens` the token limit, `text.format` the response format, the flat function tools chat's nested
ones. From there it is prepared, admitted, budgeted, generated, recorded and billed exactly as a chat is; only
the response object and the stream's events differ (`response_object` here, `responses_render.py`).

Nothing is stored: `store: true`, `previous_response_id` and the other stateful parameters are a 400 naming
the parameter (the client resends its items), and every response object says `store: false`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tally_runtime.engine.base import TokenLogprob
from tally_runtime.protocol import CALL_ID, MAX_TOOLS, ApiError, ChatCompletionRequest, null_is_omitted, validated
from tally_runtime.streaming import ChoiceResult, ResponseHeader, chat_logprobs
from tally_runtime.tools import ToolPlan, reply

MAX_INPUT_ITEMS = 4096  # more items than this are refused before they are translated (the context bounds them too)
MAX_METADATA_KEYS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# Parameters that need state this server does not keep, or features it does not have: a 400 naming each
STATEFUL = {
    "previous_response_id": "previous_response_id needs a stored response, and this server stores none: resend "
                            "the conversation's items in input (store: false)",
    "conversation": "conversation needs a stored conversation, and this server stores none: resend the "
                    "conversation's items in input",
    "prompt": "prompt templates are not supported by this server: send the text in instructions and input",
}
EXTENSIONS = ("ignore_eos", "min_tokens", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "seed", "stop")
# A chat parameter's name in the Responses API, for the refusals the shared preparation raises
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format", "logprobs": "include", "top_logprobs": "top_logprobs"}
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the output text's logprobs


class FormatText(BaseModel):
    """`text.format`: free text, any JSON object, or JSON matching a schema (named, at the top level)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: FormatText | None = None


class FunctionTool(BaseModel):
    """A function tool as the Responses API writes it: flat, not nested under `function`."""

    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """The request body. Unknown fields are accepted and ignored (logged), as for chat."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        return null_is_omitted(cls, data)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    background: bool | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=0)
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = Field(None, max_length=16)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # Sampling extensions chat accepts (benchmark clients send them), passed on as they are
    ignore_eos: Any = None
    min_tokens: Any = None
    top_k: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    seed: Any = None
    stop: Any = None


@dataclass(frozen=True, slots=True)
class ResponsesHeader(ResponseHeader):
    """A response's id and what its response object repeats of the request."""

    echo: Mapping[str, Any] = field(default_factory=dict)


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request is served as; a 400 naming the Responses parameter otherwise."""
    refuse_unsupported(req)
    body: dict[str, Any] = {
        "messages": messages(req), "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.model is not None:
        body["model"] = req.model
    for name in EXTENSIONS:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    user = req.user or req.safety_identifier
    if user is not None:
        body["user"] = user
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters, "strict": t.strict}}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.max_tool_calls is not None and req.tools:  # at most this many calls: the grammar's bound (tools.py)
        if req.max_tool_calls == 0:
            if req.tool_choice not in (None, "auto", "none"):
                raise ApiError(400, "max_tool_calls is 0, so no tool can be called as tool_choice asks",
                               param="max_tool_calls")
            body["tool_choice"] = "none"
        else:
            body["max_tool_calls"] = req.max_tool_calls
    if LOGPROBS in (req.include or ()):  # each output token's logprob, and `top_logprobs` alternatives
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    try:
        return validated(ChatCompletionRequest, body)
    except ApiError as error:
        raise renamed(error) from None


def turns(chat: ChatCompletionRequest) -> list[int]:
    """PURE: where each droppable turn of the conversation begins (indices into its messages): the instructions
    and leading system messages stay, and a tool result goes with the call before it (a template would refuse a
    result whose call was dropped)."""
    starts: list[int] = []
    for index, message in enumerate(chat.messages):
        if message.role in ("system", "developer") and not starts:
            continue
        if message.role == "tool" and starts:
            continue
        starts.append(index)
    return starts


def truncated(chat: ChatCompletionRequest, drop: int) -> ChatCompletionRequest:
    """PURE: the conversation without its `drop` oldest turns (`truncation: auto`; at least one turn stays)."""
    starts = turns(chat)
    drop = min(drop, len(starts) - 1)
    if drop <= 0:
        return chat
    messages = chat.messages[:starts[0]] + chat.messages[starts[drop]:]
    return chat.model_copy(update={"messages": messages})


def refuse_unsupported(req: ResponsesRequest) -> None:
    for param, why in STATEFUL.items():
        if getattr(req, param) is not None:
            raise ApiError(400, why, param=param, code="unsupported_parameter")
    if req.store:
        raise ApiError(400, "store: true needs a response store, and this server keeps none: set store to false "
                            "(or leave it out) and resend the conversation's items in input", param="store",
                       code="unsupported_parameter")
    if req.background:
        raise ApiError(400, "background responses need a response store, and this server keeps none",
                       param="background", code="unsupported_parameter")
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise ApiError(400, f"Tools of type {tool.type[:64]!r} are not supported by this server (function "
                                "tools are)", param=f"tools[{i}].type", code="unsupported_parameter")
        if not tool.name:
            raise ApiError(400, "A function tool needs a name", param=f"tools[{i}].name")
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                                for k, v in metadata.items()):
        raise ApiError(400, f"metadata holds at most {MAX_METADATA_KEYS} keys of at most {MAX_METADATA_KEY} "
                            f"characters, each value at most {MAX_METADATA_VALUE}", param="metadata")
    if isinstance(req.input, list) and len(req.input) > MAX_INPUT_ITEMS:
        raise ApiError(400, f"{len(req.input)} input items; at most {MAX_INPUT_ITEMS} are accepted", param="input")


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    """`auto`, `required`, `none`, or `{"type": "function", "name": ...}` as chat writes them."""
    if isinstance(choice, str):
        if choice not in ("auto", "required", "none"):
            raise ApiError(400, f"Invalid value for tool_choice: {choice[:64]!r}", param="tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(400, "tool_choice must be auto, required, none or {\"type\": \"function\", \"name\": ...}",
                       param="tool_choice", code="unsupported_parameter")
    return {"type": "function", "function": {"name": choice["name"]}}


def messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` as the system message, then each input item as chat messages: consecutive
    `function_call` items join the assistant message before them as its tool calls."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"Invalid role {str(role)[:32]!r}: user, assistant, system or developer",
                               param=f"input[{i}].role")
            out.append({"role": role, "content": item_text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant":  # the calls of the assistant turn just before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                        "content": item_text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary an SDK resends: not shown to the model again, as OpenAI does
        else:
            raise ApiError(400, f"Input items of type {str(kind)[:64]!r} are not supported by this server (messages, "
                                "function_call and function_call_output are)", param=f"input[{i}].type",
                           code="unsupported_parameter")
    return out


def _field(item: Mapping[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"Missing required parameter: 'input[{i}].{name}'", param=f"input[{i}].{name}")
    if name == "call_id" and not re.match(CALL_ID, value):
        raise ApiError(400, "A call_id is 1 to 128 letters, digits and _.:-", param=f"input[{i}].call_id")
    return value


def item_text(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts (`input_text`, `output_text`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "Content must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(400, f"Content parts of type {str(kind)[:64]!r} are not supported by this server (text "
                                "parts are)", param=f"{param}[{j}]", code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def renamed(error: ApiError) -> ApiError:
    """A refusal of the shared chat preparation, in the Responses API's parameter names."""
    param = error.param
    if param is not None:
        head = param.partition(".")[0]
        if head in PARAMS:  # a message's index is not its input item's (instructions, calls joined): the whole
            param = PARAMS[head]
    message = error.message
    for chat_name in ("max_completion_tokens", "max_tokens", "response_format"):
        message = message.replace(chat_name, PARAMS[chat_name])
    out = ApiError(error.status, message, param=param, code=error.code, headers=error.headers)
    out.recorded = error.recorded
    return out


def header(req: ResponsesRequest, chat_header: ResponseHeader) -> ResponsesHeader:
    """The response's id (`resp_...`) and what its object repeats of the request."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    echo = {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": dict(req.metadata or {}), "parallel_tool_calls": req.parallel_tool_calls,
        "max_tool_calls": req.max_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p, "tools": tools,
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none"),
        "text": {"format": fmt or {"type": "text"}}, "truncation": req.truncation or "disabled",
        "user": req.user, "store": False, "previous_response_id": None, "reasoning": None,
    }
    suffix = chat_header.id.rsplit("-", 1)[-1]
    return ResponsesHeader(f"resp_{suffix}", chat_header.created, chat_header.model, echo)


def output_items(response_id: str, text: str, finish_reason: str | None, tools: ToolPlan | None,
                 logprobs: Sequence[TokenLogprob] | None = None) -> list[dict[str, Any]]:
    """The output: a message with the text, or (a tool call made) a `function_call` item per call, after a
    message with any text the model wrote around them. Ids derive from the response's, so they are stable."""
    content, calls = reply(tools, text, finish_reason)
    items: list[dict[str, Any]] = []
    if content or not calls:
        items.append(message_item(response_id, content or "", status_of(finish_reason), logprobs))
    for k, call in enumerate(calls or ()):
        items.append(function_call_item(response_id, k, call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    return items


def message_id(response_id: str) -> str:
    return f"msg_{response_id.removeprefix('resp_')}"


def message_item(response_id: str, text: str | None, status: str,
                 logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": token_logprobs(logprobs or ())}]
    return {"id": message_id(response_id), "type": "message", "role": "assistant", "status": status,
            "content": content}


def token_logprobs(logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """PURE: each token's logprob and its alternatives, as the Responses API writes them (chat's objects)."""
    return list(chat_logprobs(logprobs)["content"])


def function_call_item(response_id: str, k: int, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": f"fc_{response_id.removeprefix('resp_')}_{k}", "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def usage_of(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's names: the same engine counts."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": chat_usage["total_tokens"]}


# What a stream's opening events leave out of the request's echo: the closing event (what the SDK's final response
# is read from) carries it whole. Repeated in all three, 7 MB of tools sent 21 MB back
BRIEF: dict[str, Any] = {"tools": [], "instructions": None}


def response_object(head: ResponseHeader, status: str, output: Sequence[dict[str, Any]],
                    usage: Mapping[str, Any] | None, finish_reason: str | None = None,
                    error: Mapping[str, Any] | None = None, brief: bool = False) -> dict[str, Any]:
    """The response object: `in_progress` (opening a stream: `brief`, without the request's tools and
    instructions), `completed`, `incomplete` (cut at max_output_tokens) or `failed`."""
    echo = head.echo if isinstance(head, ResponsesHeader) else {}
    if brief:
        echo = {**echo, **{k: v for k, v in BRIEF.items() if k in echo}}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": head.id, "object": "response", "created_at": head.created, "status": status, "model": head.model,
        "output": list(output), "usage": usage_of(usage) if usage is not None else None, "error": error,
        "incomplete_details": incomplete, **echo,
        **({"completed_at": int(time.time())} if status == "completed" else {}),
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def responses_response(head: ResponseHeader, results: Sequence[ChoiceResult], usage: dict[str, Any],
                       tools: ToolPlan | None = None) -> dict[str, Any]:
    """A non-streamed response: its one generation's output items and the engine's usage."""
    result = results[0]
    items = output_items(head.id, result.text, result.finish_reason, tools, result.logprobs)
    return response_object(head, status_of(result.finish_reason), items, usage, result.finish_reason)
