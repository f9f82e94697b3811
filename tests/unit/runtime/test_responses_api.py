"""The Responses API's translation (pure): items to chat messages, refusals in its own parameter names, the
engine's usage in its names, and a stream's events in the order and numbering the SDK reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tally_runtime.engine.base import Delta, FinishReason
from tally_runtime.prepare import CHAT, Job
from tally_runtime.protocol import ApiError
from tally_runtime.responses_api import ResponsesRequest, header, messages, renamed, to_chat, usage_of
from tally_runtime.responses_render import ResponsesRenderer
from tally_runtime.streaming import ResponseHeader
from tally_runtime.tools import ToolPlan


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_items_become_messages_with_calls_joined_to_the_assistant_turn_before_them() -> None:
    req = request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c3", "name": "get", "arguments": "{}"},
    ])
    out = messages(req)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant"]
    assert out[1]["content"] == "Weather ?" and out[2]["content"] == "Looking."
    assert [c["id"] for c in out[2]["tool_calls"]] == ["c1", "c2"] and out[3]["tool_call_id"] == "c1"
    assert out[4] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}
    chat = to_chat(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "function_call", "call_id": "bad id", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
])
def test_refusals_name_the_responses_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        to_chat(request(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_chat_refusal_is_renamed_into_the_responses_api() -> None:
    error = renamed(ApiError(400, "Please reduce the prompt or max_tokens.", param="max_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "Please reduce the prompt or max_output_tokens.")
    assert renamed(ApiError(400, "x", param="messages.3.content")).param == "input"
    assert renamed(ApiError(400, "x", param="response_format")).param == "text.format"


def test_usage_is_the_engines_count_in_the_responses_names() -> None:
    chat = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 3}}
    assert usage_of(chat) == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}


def job(req: ResponsesRequest, tools: ToolPlan | None = None) -> Job:
    from tally_runtime.engine.base import SamplingParams

    head = header(req, ResponseHeader("chatcmpl-abc", 1, "m"))
    return Job(CHAT, head, ((1, 2),), ("",), 1, SamplingParams(max_tokens=8), False, True, False, False, tools=tools)


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == f"event: {payload['type']}"
            out.append(payload)
    return out


def test_a_text_stream_opens_deltas_closes_and_completes_with_usage_numbered_in_order() -> None:
    render = ResponsesRenderer(job(request()), [])
    render.add(0, Delta(text="Hel", token_ids=(1,)))
    render.add(0, Delta(text="lo", token_ids=(2,), finish_reason=FinishReason.STOP))
    out = events(render.take() + render.finish({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    done = out[-1]["response"]
    assert done["id"] == "resp_abc" and done["store"] is False and done["usage"]["output_tokens"] == 2
    assert done["output"][0]["content"][0]["text"] == "Hello" == out[6]["text"]


def test_a_stream_cut_at_its_limit_is_incomplete_and_a_failure_is_an_error_then_failed() -> None:
    render = ResponsesRenderer(job(request()), [])
    render.add(0, Delta(text="a", token_ids=(1,), finish_reason=FinishReason.LENGTH))
    cut = events(render.take() + render.finish({"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}))
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    render = ResponsesRenderer(job(request()), [])
    render.add(0, Delta(text="a", token_ids=(1,)))
    failed = events(render.take() + render.fail("The engine aborted the generation", 500))
    assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]


def test_a_function_call_stream_sends_its_arguments_once_whole() -> None:
    plan = ToolPlan('{"type": "object"}', named="get_weather")
    render = ResponsesRenderer(job(request(), plan), [])
    render.add(0, Delta(text='{"city": ', token_ids=(1,)))
    assert [e["type"] for e in events(render.take())] == ["response.created", "response.in_progress"]
    render.add(0, Delta(text='"Rome"}', token_ids=(2,), finish_reason=FinishReason.STOP))
    out = events(render.take())
    assert [e["type"] for e in out] == ["response.output_item.added", "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done"]
    assert out[0]["item"]["arguments"] == "" and out[-1]["item"]["arguments"] == '{"city": "Rome"}'
    assert out[0]["sequence_number"] == 2


def test_several_calls_in_one_stream_are_each_sent_whole_as_items_of_their_own() -> None:
    """`tool_choice: "required"` with parallel calls allowed may return two calls: each is its own output item
    with its own `.done` event, in order, and the closing response lists both (a contract test met this)."""
    render = ResponsesRenderer(job(request(), ToolPlan('{"type": "array"}')), [])
    render.add(0, Delta(text='[{"name": "get_weather", "parameters": {"city": "Suida"}}, ', token_ids=(1,)))
    render.add(0, Delta(text='{"name": "get_weather", "parameters": {"city": "Venice"}}]', token_ids=(2,),
                        finish_reason=FinishReason.STOP))
    out = events(render.take() + render.finish({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    done = [(e["item_id"], e["output_index"], e["arguments"]) for e in out
            if e["type"] == "response.function_call_arguments.done"]
    items = out[-1]["response"]["output"]
    assert [(item["id"], k, item["arguments"]) for k, item in enumerate(items)] == done
    assert [json.loads(a)["city"] for _, _, a in done] == ["Suida", "Venice"] and done[0][0] != done[1][0]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))


def test_chats_sampling_extensions_pass_through_and_are_validated_as_chat_validates_them() -> None:
    chat = to_chat(request(ignore_eos=True, top_k=5, stop=["\n"]))
    assert (chat.ignore_eos, chat.top_k, chat.stop) == (True, 5, ["\n"])
    with pytest.raises(ApiError) as refused:
        to_chat(request(top_k=0))
    assert refused.value.param == "top_k"


def test_a_streams_tools_and_instructions_are_sent_once_in_its_closing_event() -> None:
    """The request's tools were echoed in `response.created`, `response.in_progress` and the closing event: 7 MB of
    tools sent 21 MB back. The opening events leave them out; the closing one, which the SDK's final response is
    read from, carries them whole."""
    tool = {"type": "function", "name": "lookup", "description": "x" * 50_000,
            "parameters": {"type": "object", "properties": {}}}
    render = ResponsesRenderer(job(request(tools=[tool], instructions="i" * 20_000)), [])
    render.add(0, Delta(text="ok", token_ids=(1,), finish_reason=FinishReason.STOP))
    raw = render.take() + render.finish({"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3})
    out = events(raw)
    assert out[0]["response"]["tools"] == [] and out[1]["response"]["instructions"] is None
    assert out[-1]["response"]["tools"][0]["name"] == "lookup" and len(out[-1]["response"]["instructions"]) == 20_000
    assert raw.count(b"x" * 50_000) == 1


def test_a_null_reads_as_the_parameter_left_out_as_the_openai_api_takes_it() -> None:
    """`temperature: null`, `top_p: null` and `parallel_tool_calls: null` were 400s (clients that build a body
    from optional settings send them); a required parameter given as null is still missing."""
    from tally_runtime.protocol import ChatCompletionRequest, CompletionRequest, validated

    nulls = {"temperature": None, "top_p": None, "parallel_tool_calls": None, "n": None, "stream": None}
    chat = to_chat(request(**nulls, tool_choice=None, max_output_tokens=None))
    assert (chat.temperature, chat.top_p, chat.parallel_tool_calls, chat.stream) == (1.0, 1.0, True, False)
    direct = validated(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **nulls})
    assert (direct.temperature, direct.n, direct.parallel_tool_calls) == (1.0, 1, True)
    completion = validated(CompletionRequest, {"prompt": "hi", "temperature": None, "max_tokens": None})
    assert completion.temperature == 1.0
    with pytest.raises(ApiError) as missing:
        validated(ResponsesRequest, {"input": None})
    assert missing.value.param == "input"
    with pytest.raises(ApiError) as missing:
        validated(ChatCompletionRequest, {"messages": None})
    assert missing.value.param == "messages"


def test_with_tools_offered_a_reply_streams_its_text_as_it_is_written() -> None:
    """Issue 62, item 4, on /v1/responses: the generic format's reply arrived as one delta at the end."""
    from tally_runtime.tools import generic_plan

    plan = generic_plan(to_chat(request(tools=[{"type": "function", "name": "lookup", "parameters": {}}])),
                        {"lookup": {"type": "object"}})
    render = ResponsesRenderer(job(request(), plan), [])
    render.add(0, Delta(text='{"response": "Hel', token_ids=(1,)))
    first = [e for e in events(render.take()) if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in first] == ["Hel"]
    render.add(0, Delta(text='lo"}', token_ids=(2,), finish_reason=FinishReason.STOP))
    out = events(render.take() + render.finish({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}))
    assert [e["delta"] for e in out if e["type"] == "response.output_text.delta"] == ["lo"]
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"


def test_max_tool_calls_bounds_the_calls_a_response_may_make() -> None:
    """Issue 62, item 6: `max_tool_calls` was accepted and ignored. The grammar allows at most that many calls
    (the generic format's array, `required`'s), 0 offers none, and an engine parser's extra calls are dropped."""
    import json as json_

    from tally_runtime.tools import ToolPlan, plan_tools, tool_calls

    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]

    def max_items(**fields: Any) -> Any:
        plan = plan_tools(to_chat(request(tools=tools, **fields)))
        assert plan is not None and plan.schema is not None
        schema = json_.loads(plan.schema)
        array = schema["anyOf"][0]["properties"]["tool_calls"] if "anyOf" in schema else schema
        return array.get("maxItems")

    assert max_items() is None and max_items(max_tool_calls=3) == 3 and max_items(max_tool_calls=1) == 1
    assert max_items(max_tool_calls=3, tool_choice="required") == 3
    assert max_items(max_tool_calls=3, parallel_tool_calls=False) == 1
    assert plan_tools(to_chat(request(tools=tools, max_tool_calls=0))) is None  # answered in text
    with pytest.raises(ApiError) as refused:
        to_chat(request(tools=tools, max_tool_calls=0, tool_choice="required"))
    assert refused.value.param == "max_tool_calls"
    parser = lambda text: ("", [("lookup", "{}")] * 3)  # noqa: E731
    chat = to_chat(request(tools=tools, max_tool_calls=2))
    plan = plan_tools(chat, lambda: parser)
    assert plan is not None and plan.max_calls == 2
    assert len(tool_calls(plan, "anything")[1] or []) == 2
    assert len(tool_calls(ToolPlan(None, parse=parser), "anything")[1] or []) == 3


def test_truncation_drops_whole_turns_oldest_first_and_keeps_the_instructions() -> None:
    from tally_runtime.responses_api import truncated, turns

    chat = to_chat(request(instructions="Be brief.", input=[
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"role": "user", "content": "b"}]))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert turns(chat) == [1, 2, 4]  # the call's result goes with it
    assert [m.role for m in truncated(chat, 1).messages] == ["system", "assistant", "tool", "user"]
    assert [m.role for m in truncated(chat, 2).messages] == ["system", "user"]
    assert [m.role for m in truncated(chat, 9).messages] == ["system", "user"]  # the last turn always stays
