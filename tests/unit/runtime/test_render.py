"""The event renderer's fast path gives the same bytes as the plain dict path."""

from __future__ import annotations

import random

import pytest

from tally_runtime import sse
from tally_runtime.engine.base import Delta, FinishReason, SamplingParams, TokenLogprob
from tally_runtime.prepare import CHAT, COMPLETIONS, Endpoint, Job
from tally_runtime.render import EventRenderer
from tally_runtime.streaming import ResponseHeader
from tally_runtime.usage import ChoiceUsage

TEXTS = ["", " tok", "naïve 日本語 🎉", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x1f\u2028", "data: x\n\n"]


def job(endpoint: Endpoint, n: int = 2, echo: bool = False, continuous: bool = False) -> Job:
    return Job(endpoint=endpoint, header=ResponseHeader("id-1", 1, "m"), prompts=((1, 2),), prompt_texts=("Hi",),
               n=n, sampling=SamplingParams(max_tokens=8), echo=echo, stream=True, include_usage=False,
               continuous_usage=continuous)


def deltas(rng: random.Random) -> list[tuple[int, Delta]]:
    out = []
    for step in range(40):
        index = rng.randrange(2)
        logprobs = (TokenLogprob("a", -0.5, (("a", -0.5),)),) if rng.random() < 0.1 else None
        finish = FinishReason.LENGTH if step >= 38 else None
        out.append((index, Delta(text=rng.choice(TEXTS), token_ids=(5,), logprobs=logprobs, prompt_tokens=2,
                                 completion_tokens=step, finish_reason=finish)))
    return out


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("echo", "continuous"), [(False, False), (True, False), (False, True)])
def test_event_renderer_equals_the_dict_path(endpoint: Endpoint, echo: bool, continuous: bool) -> None:
    """Every event, fast or not, is byte-for-byte what dumping the chunk dicts gives."""
    the_job = job(endpoint, echo=echo and endpoint == COMPLETIONS, continuous=continuous)
    usage = [ChoiceUsage(i, 0, 2) for i in range(2)]
    fast, plain = EventRenderer(the_job, usage), EventRenderer(the_job, usage)
    fast_out = b""
    plain_out: list[bytes] = []
    for index, delta in deltas(random.Random(endpoint.name + str(echo) + str(continuous))):
        usage[index].observe(delta)
        fast.add(index, delta)
        if index == 1:
            fast_out += fast.take()
        plain_out.extend(sse.event(event) for event in plain._dicts(index, delta))
    fast_out += fast.take()
    assert fast_out == b"".join(plain_out)
    assert fast.take() == b""
    assert bool(fast.templates) is not continuous  # the fast path was taken, except with running usage


def test_a_streamed_generic_format_reply_is_its_response_text_and_a_call_its_tool_calls() -> None:
    """`tool_choice: auto` without the engine's parser (tools.generic_plan): the held output is
    `{"response": ...}` or `{"tool_calls": [...]}`; streamed, the client gets the response's text (never the JSON
    around it) or the calls."""
    import dataclasses
    import json

    from tally_runtime.protocol import ChatCompletionRequest
    from tally_runtime.tools import generic_plan

    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]})
    the_job = dataclasses.replace(job(CHAT, n=1), tools=generic_plan(req, {"get_time": {"type": "object"}}))

    def streamed(text: str) -> list[dict[str, object]]:
        usage = [ChoiceUsage(0, 0, 2)]
        renderer = EventRenderer(the_job, usage)
        for i, piece in enumerate((text[:5], text[5:])):
            delta = Delta(text=piece, token_ids=(5,), prompt_tokens=2, completion_tokens=i + 1,
                          finish_reason=FinishReason.STOP if i else None)
            usage[0].observe(delta)
            renderer.add(0, delta)
        raw = renderer.take().decode()
        return [json.loads(line[6:])["choices"][0]["delta"] for line in raw.split("\n\n") if line.startswith("data: ")]

    said = "".join(str(d.get("content") or "") for d in streamed('{"response": "Paris"}'))
    assert said == "Paris"
    calls = [d["tool_calls"] for d in streamed('{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
             if d.get("tool_calls")]
    assert calls and calls[0][0]["function"]["name"] == "get_time"  # type: ignore[index]


def generic_job(max_tokens: int = 8) -> Job:
    import dataclasses

    from tally_runtime.protocol import ChatCompletionRequest
    from tally_runtime.tools import generic_plan

    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]})
    return dataclasses.replace(job(CHAT, n=1), tools=generic_plan(req, {"get_time": {"type": "object"}}))


def chunks_of(the_job: Job, pieces: list[str], finish: FinishReason) -> list[list[dict[str, object]]]:
    """The chunks each piece's delta produced (the last piece carries `finish`)."""
    import json

    usage = [ChoiceUsage(0, 0, 2)]
    renderer = EventRenderer(the_job, usage)
    out = []
    for i, piece in enumerate(pieces):
        delta = Delta(text=piece, token_ids=(5,), prompt_tokens=2, completion_tokens=i + 1,
                      finish_reason=finish if i == len(pieces) - 1 else None)
        usage[0].observe(delta)
        renderer.add(0, delta)
        raw = renderer.take().decode()
        out.append([json.loads(line[6:])["choices"][0] for line in raw.split("\n\n") if line.startswith("data: ")])
    return out


def test_with_tools_offered_a_reply_streams_as_it_is_written_not_as_one_delta_at_the_end() -> None:
    """Issue 62, item 4: with tools offered the first text came at 1.54 s of 1.54 s (0.22 s without tools)."""
    pieces = ['{"res', 'ponse": "Par', 'is is the cap', 'ital \\u00e9\\', 'n\\ud83c', '\\udf89 ok"}']
    steps = chunks_of(generic_job(), pieces, FinishReason.STOP)
    text = [[str(c["delta"].get("content") or "") for c in step] for step in steps]  # type: ignore[attr-defined]
    assert text[0] == [""] and text[1] == ["Par"] and text[2] == ["is is the cap"]  # the role, then the text
    assert "".join("".join(t) for t in text) == "Paris is the capital é\n🎉 ok"
    assert steps[-1][-1]["finish_reason"] == "stop"


@pytest.mark.parametrize(("pieces", "content", "calls"), [
    (['{"response": "Once upon a ti'], "Once upon a ti", []),
    (['{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_'], "", ["get_time"]),
    (['{"tool_calls": [{"na'], "", []),
], ids=["reply", "one-call-whole", "no-call-whole"])
def test_a_reply_cut_at_its_limit_is_its_text_or_its_whole_calls_never_the_wrapper(
        pieces: list[str], content: str, calls: list[str]) -> None:
    """Issue 62, item 3: cut by `max_tokens` with tools offered, the client got `{"tool_calls": [{"name` as text
    (12 of 12, chat and Responses, streamed and not)."""
    from tally_runtime.responses_api import output_items
    from tally_runtime.streaming import ChoiceResult, chat_response

    the_job = generic_job()
    streamed = [c for step in chunks_of(the_job, pieces, FinishReason.LENGTH) for c in step]
    said = "".join(str(c["delta"].get("content") or "") for c in streamed)  # type: ignore[attr-defined]
    made = [call["function"]["name"]
            for c in streamed for call in c["delta"].get("tool_calls") or []]  # type: ignore[attr-defined]
    assert (said, made, streamed[-1]["finish_reason"]) == (content, calls, "length")
    assert the_job.tools is not None
    whole = chat_response(the_job.header, [ChoiceResult(0, "".join(pieces), finish_reason="length")], {}, the_job.tools)
    message = whole["choices"][0]["message"]
    assert (message["content"] or "", [c["function"]["name"] for c in message.get("tool_calls") or []],
            whole["choices"][0]["finish_reason"]) == (content, calls, "length")
    items = output_items("resp_1", "".join(pieces), "length", the_job.tools)
    texts = [part["text"] for item in items if item["type"] == "message" for part in item["content"]]
    assert "".join(texts) == content and [i["name"] for i in items if i["type"] == "function_call"] == calls
    assert not any("{" in text for text in texts)
