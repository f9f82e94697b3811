"""Conformance of /v1/completions against the real CPU runtime (OPENAI_PROTOCOL.md §7 ids in names)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest
from runtime_harness import sse_payloads

PROMPT = "The capital of France is"


def stream(http: httpx.Client, **body: Any) -> tuple[httpx.Response, list[Any]]:
    response = http.post("/v1/completions", json={"prompt": PROMPT, "stream": True, **body})
    assert response.status_code == 200, response.text
    return response, sse_payloads(response.content)


def content(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e["choices"]]


def test_t01_t04_framing_headers_and_done(http: httpx.Client) -> None:
    response, events = stream(http, max_tokens=6, temperature=0)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert re.fullmatch(rb"(data: [^\n]*\n\n)+", response.content)
    assert b"\r" not in response.content
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1


def test_t07_t09_chunk_shape(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=6, temperature=0)
    chunks = content(events)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("cmpl-")
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert all(c["object"] == "text_completion" and c["model"] == "smollm2-135m-instruct" for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] in {"stop", "length"} and all(f is None for f in finishes[:-1])
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_t11_no_usage_unless_asked(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=6, temperature=0)
    assert all(e["choices"] and e["usage"] is None for e in events[:-1])


def test_t12_t13_usage_chunk_once_last(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=6, temperature=0, stream_options={"include_usage": True})
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] is not None
    assert all(c["choices"] and c["usage"] is None for c in chunks)
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == 5 and 0 < usage["completion_tokens"] <= 6


def test_t10_stream_equals_non_stream_greedy(http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused")
    plain = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=12, temperature=0)
    text, usage = "", None
    for chunk in client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=12,
                                           temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == plain.choices[0].text and text
    assert usage is not None and plain.usage is not None
    assert usage.model_dump() == plain.usage.model_dump()


def test_t10_stream_equals_non_stream_seeded(http: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    plain = http.post("/v1/completions", json=body).json()
    _, events = stream(http, **{**body, "prompt": "Once upon a time"})
    streamed = "".join(c["choices"][0]["text"] for c in content(events))
    assert streamed == plain["choices"][0]["text"]


def test_t14_length_counts_exactly_max_tokens(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=9, temperature=0, ignore_eos=True,
                       stream_options={"include_usage": True})
    assert content(events)[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 9


def test_t17_n2_indexes_and_prompt_once(http: httpx.Client) -> None:
    one = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}).json()
    _, events = stream(http, n=2, max_tokens=4, ignore_eos=True, temperature=0.8,
                       stream_options={"include_usage": True})
    chunks = content(events)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    for index in (0, 1):
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["index"] == index]
        assert [f for f in finishes if f] == ["length"]
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 8


def test_t18_prompt_list_with_n(http: httpx.Client) -> None:
    prompts = ["Hello", "The sky is blue because"]
    sizes = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
             for p in prompts]
    response = http.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 3, "ignore_eos": True})
    body = response.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == sum(sizes)
    assert body["usage"]["completion_tokens"] == 12


def test_token_id_prompts(http: httpx.Client) -> None:
    text = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}).json()
    ids = http.post("/v1/completions", json={"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 5,
                                              "temperature": 0}).json()
    # the ids are PROMPT's tokenization: the same prompt, so the same greedy completion and usage
    assert ids["choices"][0]["text"] == text["choices"][0]["text"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # the cache may differ, not the counts
        assert ids["usage"][key] == text["usage"][key]
    assert text["usage"]["prompt_tokens"] == 5
    nested = http.post("/v1/completions", json={"prompt": [[504, 3575], [4649, 314]], "max_tokens": 2}).json()
    assert len(nested["choices"]) == 2 and nested["usage"]["prompt_tokens"] == 4


def test_t23_t24_echo(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=3, echo=True, temperature=0)
    assert content(events)[0]["choices"][0]["text"].startswith(PROMPT)
    only = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True}).json()
    assert only["choices"][0]["text"] == PROMPT
    assert only["usage"]["completion_tokens"] == 0


def test_text_offset_with_echo_starts_at_the_prompts_length(http: httpx.Client) -> None:
    """Offsets index the text the choice returns; with echo that text starts with the prompt."""
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    _, events = stream(http, **{k: v for k, v in body.items() if k != "prompt"})
    streamed = [o for c in content(events) for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    for offsets, text, tokens in ((plain["logprobs"]["text_offset"], plain["text"], plain["logprobs"]["tokens"]),
                                  (streamed, None, None)):
        assert offsets[0] == len(PROMPT), offsets
        if text is not None and tokens is not None:
            assert [text[o:o + len(t)] for o, t in zip(offsets, tokens, strict=True)] == tokens


def test_t22_stop_string_not_returned(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True, "logprobs": 0}).json()["choices"][0]
    full, pieces = reply["text"], reply["logprobs"]["tokens"]
    stop = full.strip().split()[2]
    _, events = stream(http, max_tokens=12, temperature=0, stop=[stop, "zzzz"],
                       stream_options={"include_usage": True})
    chunks = content(events)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == full[: full.index(stop)]
    assert stop not in text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # the tokens that formed the stop string were generated, so they are counted: every token up to the
    # one that completed it
    needed = next(k for k in range(1, len(pieces) + 1) if stop in "".join(pieces[:k]))
    assert events[-2]["usage"]["completion_tokens"] == needed


def test_t25_logprobs_shape(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=5, logprobs=2, temperature=0)
    offsets: list[int] = []
    for chunk in content(events):
        logprobs = chunk["choices"][0]["logprobs"]
        n = len(logprobs["tokens"])
        assert n == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"])
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                       strict=True):
            # greedy: the sampled token is the best alternative, and it is among them (2 asked, +1 at most)
            assert 1 <= len(top) <= 3 and top[token] == logprob == max(top.values()) and logprob <= 0
        offsets += logprobs["text_offset"]
    assert offsets == sorted(offsets) and len(offsets) == 5


def test_t19_continuous_usage(http: httpx.Client) -> None:
    _, events = stream(http, max_tokens=6, ignore_eos=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    running = [c["usage"]["completion_tokens"] for c in content(events)]
    assert running == sorted(running) and running[-1] == events[-2]["usage"]["completion_tokens"] == 6


def test_t29_min_tokens(http: httpx.Client) -> None:
    chat = {"messages": [{"role": "user", "content": "Reply with one word: yes or no?"}], "max_tokens": 40,
            "temperature": 0}
    control = http.post("/v1/chat/completions", json=chat).json()
    assert control["choices"][0]["finish_reason"] == "stop" and control["usage"]["completion_tokens"] < 12
    held = http.post("/v1/chat/completions", json={**chat, "min_tokens": 12}).json()
    assert held["usage"]["completion_tokens"] >= 12


@pytest.mark.parametrize("extra", [
    pytest.param({"best_of": 1, "repetition_penalty": 1.0, "stop": None, "user": "u1", "suffix": "x"}, id="bench"),
    pytest.param({"top_k": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5, "skip_special_tokens": True},
                 id="sampling"),
])
def test_t28_extension_fields_accepted(http: httpx.Client, extra: dict[str, Any]) -> None:
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True, **extra})
    assert response.status_code == 200
    assert sse_payloads(response.content)[-1] == "[DONE]"
