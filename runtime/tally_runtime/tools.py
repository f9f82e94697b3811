"""PURE: OpenAI tool calls made by constrained decoding.

With `tool_choice: "required"` or a named function, the output is constrained by the engine's own grammar
(the same path as `response_format`, prepare.py) so the call always parses: for a named function, to that
function's `parameters` (the output is its arguments, as vLLM does); for `required`, to a JSON array of
`{"name", "parameters"}` objects, one function name each (at most one unless `parallel_tool_calls`). The
constrained output is then turned into OpenAI's `tool_calls`; this is not a parser of free text.

With `tool_choice: "auto"` (the default with tools) the model writes calls in its own family's format
among free text, read by the engine's own parser for that family (SGLang's `FunctionCallParser`, chosen
with `--tool-call-parser` in `spec.engine.args`). An engine without one (the CPU engine, SGLang without the
flag) uses the generic format llama.cpp's server uses for models without a native one: the output is
constrained to `{"tool_calls": [{"name", "arguments"}, ...]}` or `{"response": "<text>"}`, and a system
message (`generic_instructions`) shows the model the tools and the two shapes. Either way it parses.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tally_runtime.protocol import MAX_SCHEMA_BYTES, ApiError, ChatCompletionRequest, NamedToolChoice

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
Calls = list[dict[str, Any]]  # OpenAI's `tool_calls`
# The engine's parser of a model family's calls: the text around them, and each call's (name, arguments)
Parser = Callable[[str], tuple[str, list[tuple[str, str]]]]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    schema: str | None  # the JSON schema the output is constrained to (None: free, read by `parse`)
    named: str | None = None  # the function tool_choice names: the output is its arguments
    parse: Parser | None = None  # tool_choice auto: the engine's parser, or the generic format's
    instructions: str | None = None  # the generic format: the system message that shows the tools and shapes
    answer: bool = False  # the generic format's reply is JSON in the requested response format (else text)
    max_calls: int | None = None  # the engine's parser: calls beyond are dropped (the grammar bounds the others)


def plan_tools(req: ChatCompletionRequest, parser: Callable[[], Parser | None] = lambda: None) -> ToolPlan | None:
    """What the request's tools ask of the output (None: text), or the 400 naming why it cannot be done.
    `parser` gives the engine's parser for `auto`, if it has one."""
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise ApiError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if not req.tools or choice == "none":
        return None
    parameters: dict[str, dict[str, Any]] = {}
    for tool in req.tools:
        if tool.function.name in parameters:
            raise ApiError(400, f"Two tools are named {tool.function.name!r}", param="tools")
        parameters[tool.function.name] = tool.function.parameters or EMPTY_PARAMETERS
    if req.logprobs:
        raise ApiError(400, "logprobs cannot be combined with tool calls", param="logprobs")
    if choice is None or choice == "auto":
        answer = _answer_schema(req)
        if answer is not None:  # a call, or the final answer in the requested format: the generic format holds
            return generic_plan(req, parameters, answer)  # both, whatever the engine's own parser reads
        parse = parser()
        if parse is None:
            return generic_plan(req, parameters)
        return ToolPlan(None, parse=parse, max_calls=1 if not req.parallel_tool_calls else req.max_tool_calls)
    # tool_choice required or a function: the output is a call, so a response format has nothing to shape
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in parameters:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolPlan(_bounded(parameters[name]), named=name)
    return ToolPlan(_bounded(_calls(req, parameters, "parameters")))


def _calls(req: ChatCompletionRequest, parameters: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """A JSON array of `{"name", key}` objects, one function name each (at most one unless parallel calls, at
    most `max_tool_calls`)."""
    call = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, key: schema},
                       "required": ["name", key], "additionalProperties": False}
                      for name, schema in parameters.items()]}
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    elif req.max_tool_calls is not None:
        array["maxItems"] = req.max_tool_calls
    return array


def _answer_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The schema `response_format` asks the final answer to follow (None: free text)."""
    if req.response_format is None:
        return None
    try:
        text = req.response_format.schema_text()
    except ValueError as err:
        raise ApiError(400, f"Invalid response_format: {err}", param="response_format") from None
    return None if text is None else dict(json.loads(text))


def generic_plan(req: ChatCompletionRequest, parameters: dict[str, dict[str, Any]],
                 answer: dict[str, Any] | None = None) -> ToolPlan:
    """`auto` without the engine's parser, or with a response format: the output is either calls or a response
    (text, or JSON following `answer`), as JSON the grammar guarantees (llama.cpp's generic format)."""
    schema = {"anyOf": [
        {"type": "object", "properties": {"tool_calls": _calls(req, parameters, "arguments")},
         "required": ["tool_calls"],
         "additionalProperties": False},
        {"type": "object", "properties": {"response": answer if answer is not None else {"type": "string"}},
         "required": ["response"], "additionalProperties": False}]}
    parse = _generic_parse if answer is None else _structured_parse
    return ToolPlan(_bounded(schema), parse=parse, instructions=generic_instructions(req, answer),
                    answer=answer is not None)


def generic_instructions(req: ChatCompletionRequest, answer: dict[str, Any] | None = None) -> str:
    """What the model is told of the tools and the two shapes it may answer in."""
    shown = [{"name": t.function.name, "description": t.function.description or "",
              "parameters": t.function.parameters or EMPTY_PARAMETERS} for t in req.tools or ()]
    reply = "<your reply>" if answer is None else \
        "<your final answer, as JSON following this schema: " + json.dumps(answer, ensure_ascii=False) + ">"
    return ("You can call these tools:\n" + json.dumps(shown, ensure_ascii=False) + "\n\nRespond in JSON: either "
            '{"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}]} to call tools, or '
            '{"response": ' + reply + "} to reply to the user.")


def _structured_parse(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The generic format with a response format: a reply is its JSON, as `response_format` alone gives it."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(value, dict) and "response" in value:
        return json.dumps(value["response"], ensure_ascii=False), []
    return _generic_parse(text)


def _generic_parse(text: str) -> tuple[str, list[tuple[str, str]]]:
    try:
        value = json.loads(text)
    except ValueError:
        return text, []  # cut off before it parsed (a limit): the text as it is
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return "", [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value["tool_calls"]
                    if isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c]
    return text, []


def reply(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[str | None, Calls | None]:
    """The content and OpenAI's `tool_calls` of a choice that ended with `finish_reason`: parsed whole when it
    stopped; cut by a limit, the generic format's reply so far (its text, or the calls it completed), never the
    JSON around it; any other output cut is its text as it is."""
    if plan is None:
        return text, None
    if finish_reason == "stop":
        return tool_calls(plan, text)
    if plan.instructions is not None:
        reader = GenericReply()
        reader.feed(text)
        if reader.kind == "calls":
            calls = reader.completed_calls()
            return "", [_call(name, arguments) for name, arguments in calls] or None
        if plan.answer:  # the reply's JSON as far as it came, as a response format alone leaves a cut
            opened = _ANSWER_OPEN.match(text)
            return (text[opened.end():] if opened is not None else ""), None
        return reader.text, None
    return text, None


_RESPONSE_OPEN = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_ANSWER_OPEN = re.compile(r'\s*\{\s*"response"\s*:\s*')
_CALLS_OPEN = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class GenericReply:
    """PURE: the generic format's output read as it is generated: which shape it is (`kind`: None until its
    opening is whole, then "response" or "calls"), and a response's text decoded so far, so that a reply is
    streamed as it is written instead of arriving whole at the end (`feed` returns what it adds)."""

    def __init__(self) -> None:
        self.raw = ""
        self.kind: str | None = None
        self.text = ""  # a response's text, decoded so far
        self._at = 0  # where in `raw` the undecoded rest of the response's string begins
        self._closed = False  # its closing quote was read

    def feed(self, piece: str) -> str:
        self.raw += piece
        if self.kind is None:
            opened = _RESPONSE_OPEN.match(self.raw)
            if opened is not None:
                self.kind, self._at = "response", opened.end()
            elif _CALLS_OPEN.match(self.raw) is not None:
                self.kind = "calls"
        if self.kind != "response" or self._closed:
            return ""
        added = self._decode()
        self.text += added
        return added

    def _decode(self) -> str:
        """The response string's characters from `_at` on, up to its end or to an escape not whole yet."""
        raw, at, out = self.raw, self._at, []
        while at < len(raw):
            char = raw[at]
            if char == '"':
                self._closed = True
                break
            if char != "\\":
                out.append(char)
                at += 1
                continue
            if at + 1 >= len(raw):
                break  # the rest of the escape comes with the next piece
            code = raw[at + 1]
            if code == "u":
                digits = raw[at + 2:at + 6]
                if len(digits) < 4:
                    break
                value = int(digits, 16) if all(d in "0123456789abcdefABCDEF" for d in digits) else 0xFFFD
                if 0xD800 <= value < 0xDC00 and len(raw) < at + 12:
                    break  # the first half of a pair: decoded with its second
                out.append(chr(value))
                at += 6
                continue
            out.append(_ESCAPES.get(code, ""))
            at += 2
        self._at = at
        return "".join(out).encode("utf-16", "surrogatepass").decode("utf-16", "replace")

    def completed_calls(self) -> list[tuple[str, str]]:
        """The calls whose objects are whole, in order (a reply cut among its calls)."""
        opened = _CALLS_OPEN.match(self.raw)
        if opened is None:
            return []
        decoder, at = json.JSONDecoder(), opened.end()
        calls: list[tuple[str, str]] = []
        while True:
            while at < len(self.raw) and self.raw[at] in " \t\n\r,":
                at += 1
            try:
                value, at = decoder.raw_decode(self.raw, at)
            except ValueError:
                return calls
            if isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
                calls.append((value["name"], json.dumps(value["arguments"], ensure_ascii=False)))


def tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The content and OpenAI's `tool_calls` of an output (no calls: the text is all content; a constrained
    output that does not parse, as when cut off by a limit, is content too)."""
    if plan.parse is not None:
        normal, found = plan.parse(text)
        found = found[:plan.max_calls] if plan.max_calls else found
        if not found:
            return (normal if plan.instructions is not None else text), None  # generic: its response's text
        return normal or None, [_call(name, arguments) for name, arguments in found]
    calls = _constrained(plan, text)
    return (None, calls) if calls else (text, None)


def _constrained(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.named is not None:
        return [_call(plan.named, text.strip())] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
            return None
        calls.append(_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _bounded(schema: dict[str, Any]) -> str:
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"The tools' schemas are {len(text)} bytes as JSON; at most {MAX_SCHEMA_BYTES} are "
                            "accepted", param="tools")
    return text
