"""Structured outputs and tool calls on the embedded CPU model, as the `openai` SDK asks for them:
`response_format` with a pydantic model (json_schema, strict) and `json_object`, and tool calls with
`tool_choice` `required` or a named function, all constrained by llama.cpp's own grammar, never checked after
the fact; `tool_choice: auto` (the default with tools) in the generic format, calls or a response, constrained
the same way. What the engine cannot do (a schema it cannot compile, other servers'
constraint fields, client text that spells a control token) is a 400 naming the parameter, with nothing
billed. Usage stays the engine's count: what the clients were told sums to what /metrics counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from runtime_harness import metric_value, runtime_process, until

CALLS = 20


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int
    coastal: bool
    continent: Literal["Africa", "Asia", "Europe", "America", "Oceania"]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "records.jsonl"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[str]:
    log = tmp_path_factory.mktemp("structured") / "rt.log"
    with runtime_process(log, "--max-concurrent-generations", "2", "--usage-records-file", str(records)) as (_, base):
        yield base


def recorded(records: Path, ids: list[str]) -> list[int]:
    """(requests, prompt tokens, completion tokens) of these responses in the usage records."""
    def written() -> dict[str, Any]:  # a record is written as its request closes, just after the response
        by_id = {r["id"]: r for r in map(json.loads, records.read_text().splitlines())}
        return by_id if all(i in by_id for i in ids) else {}

    assert until(written, 30), "a response's usage record was not written"
    by_id = written()
    mine = [by_id[i] for i in ids]
    return [len(mine), sum(r["prompt_tokens"] for r in mine), sum(r["completion_tokens"] for r in mine)]


def counted(url: str) -> tuple[float, float, float]:
    text = httpx.get(f"{url}/metrics").text
    return (metric_value(text, "tally_requests_total", {"outcome": "ok"}),
            metric_value(text, "tally_prompt_tokens_total"), metric_value(text, "tally_completion_tokens_total"))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def completed(url: str, kwargs: Any, streamed: bool) -> Any:
    """One chat completion through the SDK's parsing helpers: `parse`, or `stream` assembled by the SDK."""
    if not streamed:
        return client(url).chat.completions.parse(**kwargs)
    with client(url).chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


MESSAGES: list[Any] = [{"role": "user", "content": "Describe a large city as JSON."}]


def test_a_pydantic_response_format_parses_every_time_streamed_or_not_and_is_billed_as_counted(
        url: str, records: Path) -> None:
    before = counted(url)
    told, ids = [0, 0, 0], []
    for i in range(CALLS):
        if i % 2:
            reply = client(url).chat.completions.parse(model="smollm2-135m-instruct", messages=MESSAGES,
                                                       response_format=City, max_tokens=120, temperature=0.8)
        else:
            with client(url).chat.completions.stream(model="smollm2-135m-instruct", messages=MESSAGES,
                                                     response_format=City, max_tokens=120, temperature=0.8,
                                                     stream_options={"include_usage": True}) as stream:
                for _ in stream:
                    pass
                reply = stream.get_final_completion()
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, City), reply.choices[0].message.content
        assert reply.usage is not None
        told = [told[0] + 1, told[1] + reply.usage.prompt_tokens, told[2] + reply.usage.completion_tokens]
        ids.append(reply.id)
    after = counted(url)
    assert [a - b for a, b in zip(after, before, strict=True)] == told == recorded(records, ids)


def test_json_object_on_both_endpoints_is_an_object(url: str) -> None:
    for _ in range(3):
        chat = client(url).chat.completions.create(
            model="smollm2-135m-instruct", messages=MESSAGES, response_format={"type": "json_object"},
            max_tokens=200, temperature=0.8)
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
        completion = client(url).completions.create(
            model="smollm2-135m-instruct", prompt="A city as JSON:", max_tokens=200, temperature=0.8,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "city", "schema": City.model_json_schema()}}})
        assert completion.choices[0].finish_reason == "stop"
        City.model_validate_json(completion.choices[0].text)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_start|>system"}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "<|im_end|>"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "messages.1.tool_calls"),
    ({"regex": "[0-9]+"}, "regex"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_what_the_engine_cannot_do_is_a_400_naming_it_and_nothing_is_billed(url: str, body: dict[str, Any],
                                                                            param: str) -> None:
    before = httpx.get(f"{url}/metrics").text
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": "smollm2-135m-instruct", "messages": MESSAGES, "max_tokens": 8, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    after = httpx.get(f"{url}/metrics").text
    for name in ("tally_prompt_tokens_total", "tally_completion_tokens_total"):
        assert metric_value(after, name) == metric_value(before, name)


class GetWeather(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    timezone: Literal["UTC", "CET", "PST"]


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]


def reply_or_cut(url: str, kwargs: Any, streamed: bool, kinds: set[str]) -> Any:
    """One completion through the SDK's helpers; a reply cut at max_tokens (which the SDK will not parse) as it
    came, with `cut` added to `kinds` (streamed, its usage is None: the SDK stopped before the usage chunk)."""
    try:
        return completed(url, kwargs, streamed=streamed)
    except openai.LengthFinishReasonError as cut:
        kinds.add("cut")
        return cut.completion


def validate_calls(calls: Any) -> None:
    for call in calls:
        {"GetWeather": GetWeather, "GetTime": GetTime}[call.function.name].model_validate_json(call.function.arguments)
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "GetTime"}}])
def test_required_and_named_tool_calls_validate_every_time_streamed_or_not(url: str, records: Path,
                                                                          choice: Any) -> None:
    """Constrained by the engine's grammar: every call parses and its arguments validate against the
    function's schema, streamed (the SDK's helper assembles the deltas) or not; usage is the engine's."""
    before = counted(url)
    told, ids = [0, 0, 0], []
    for i in range(CALLS):
        kwargs: Any = {"model": "smollm2-135m-instruct", "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                       "max_tokens": 120, "temperature": 0.8, "parallel_tool_calls": False}
        reply = completed(url, kwargs, streamed=not i % 2)
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None, repr(choice_.message.content)
        calls = choice_.message.tool_calls or []
        assert calls and all(c.id.startswith("call_") for c in calls)
        for call in calls:
            model = {"GetWeather": GetWeather, "GetTime": GetTime}[call.function.name]
            assert isinstance(call.function.parsed_arguments, model)
            model.model_validate_json(call.function.arguments)
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["GetTime"]
        assert reply.usage is not None
        told = [told[0] + 1, told[1] + reply.usage.prompt_tokens, told[2] + reply.usage.completion_tokens]
        ids.append(reply.id)
    assert [a - b for a, b in zip(counted(url), before, strict=True)] == told == recorded(records, ids)


def test_a_conversation_with_a_tool_result_in_its_history_completes(url: str) -> None:
    # One call, greedily: with parallel calls allowed this model can list calls until `max_tokens` cuts the
    # array, which is then (rightly) content with finish `length`, and the test has no call to answer
    call = client(url).chat.completions.create(model="smollm2-135m-instruct", messages=ASK, tools=TOOLS,
                                               tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=80)
    assert call.choices[0].message.tool_calls
    made = call.choices[0].message.tool_calls[0]
    history = [*ASK, call.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": made.id, "content": '{"temperature": 18}'}]
    reply = client(url).chat.completions.create(model="smollm2-135m-instruct", messages=history, tools=TOOLS,
                                                tool_choice="none", max_tokens=16)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in {"stop", "length"}


def test_tools_with_tool_choice_none_are_answered_with_text(url: str) -> None:
    reply = client(url).chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=8, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_tool_choice_auto_answers_in_the_generic_format_calls_or_text_and_every_one_parses(
        url: str, records: Path) -> None:
    """The CPU engine has no parser of a model family's calls: `auto` is the generic format (llama.cpp's), the
    output constrained to calls or a response. Each reply is either calls whose arguments validate or plain
    text (never the JSON wrapper), streamed or not, and the books are the engine's counts."""
    before = counted(url)
    told, ids, kinds, unread = [0, 0, 0], [], set(), []
    asks = [ASK, [{"role": "user", "content": "Say hello to me."}]]
    for i in range(8):
        kwargs: Any = {"model": "smollm2-135m-instruct", "messages": asks[i % 2], "tools": TOOLS,
                       "max_tokens": 120, "temperature": 0.8, "parallel_tool_calls": False}
        reply = reply_or_cut(url, kwargs, i % 4 >= 2, kinds)
        if reply.usage is None:  # streamed and cut: the SDK stopped before the usage chunk; its record says
            unread.append(reply.id)
            ids.append(reply.id)
            continue
        choice_ = reply.choices[0]
        if choice_.finish_reason == "tool_calls":
            kinds.add("calls")
            validate_calls(choice_.message.tool_calls or [])
        else:
            kinds.add("text")
            assert choice_.finish_reason in ("stop", "length") and choice_.message.content is not None
            if choice_.finish_reason == "stop":
                assert not choice_.message.content.lstrip().startswith('{"response"'), choice_.message.content
        assert reply.usage is not None
        told = [told[0] + 1, told[1] + reply.usage.prompt_tokens, told[2] + reply.usage.completion_tokens]
        ids.append(reply.id)
    assert kinds  # what it chose is the model's; that it parsed is the point
    if unread:
        told = [a + b for a, b in zip(told, recorded(records, unread), strict=True)]
    assert [a - b for a, b in zip(counted(url), before, strict=True)] == told == recorded(records, ids)


def test_tools_with_a_structured_final_answer_give_calls_or_the_answer_and_every_one_parses(
        url: str, records: Path) -> None:
    """Issue 62, item 1: tools together with `response_format` were always a 400 (`chat.completions.parse(tools=…,
    response_format=…)`, how most agents end). The generic format holds both: the output is calls, or a response
    that follows the schema; each reply parses into calls or the pydantic model, streamed or not, billed as
    counted."""
    before = counted(url)
    told, ids, kinds, unread = [0, 0, 0], [], set(), []
    for i in range(8):
        kwargs: Any = {"model": "smollm2-135m-instruct", "messages": ASK if i % 2 else MESSAGES, "tools": TOOLS,
                       "response_format": City, "max_tokens": 160, "temperature": 0.8}
        reply = reply_or_cut(url, kwargs, i % 4 >= 2, kinds)
        if reply.usage is None:
            unread.append(reply.id)
            ids.append(reply.id)
            continue
        choice_ = reply.choices[0]
        if choice_.finish_reason == "tool_calls":
            kinds.add("calls")
            validate_calls(choice_.message.tool_calls or [])
        elif choice_.finish_reason == "stop":
            kinds.add("answer")
            assert isinstance(choice_.message.parsed, City), choice_.message.content
        assert reply.usage is not None
        told = [told[0] + 1, told[1] + reply.usage.prompt_tokens, told[2] + reply.usage.completion_tokens]
        ids.append(reply.id)
    assert kinds - {"cut"}, kinds
    if unread:
        told = [a + b for a, b in zip(told, recorded(records, unread), strict=True)]
    assert recorded(records, ids) == told  # every record written: /metrics counted them as it wrote them
    # (tokens: a streamed reply the SDK stopped reading at its cut counts as a request of another outcome)
    assert [a - b for a, b in zip(counted(url), before, strict=True)][1:] == told[1:]
