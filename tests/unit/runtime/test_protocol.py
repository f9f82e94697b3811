"""Unit tests of protocol."""

from __future__ import annotations

from typing import Any

import pytest

from tally_runtime import sse
from tally_runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_json_body, validated


@pytest.mark.parametrize(("body", "param"), [
    pytest.param({}, "prompt", id="missing"),
    pytest.param({"prompt": "x", "max_tokens": "many"}, "max_tokens", id="type"),
    pytest.param({"prompt": "x", "stop": ["1", "2", "3", "4", "5"]}, "stop", id="stops"),
    pytest.param({"prompt": "x", "top_p": 0}, "top_p", id="top-p"),
    pytest.param({"prompt": {"a": 1}}, "prompt", id="prompt-shape"),
])
def test_validation_names_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        validated(CompletionRequest, body)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_prompt_forms_accepted() -> None:
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert validated(CompletionRequest, {"prompt": prompt}).prompt == prompt


def test_unknown_fields_are_kept_for_logging() -> None:
    request = validated(CompletionRequest, {"prompt": "a", "best_of": 1, "cache_salt": "s"})
    assert request.unknown_fields() == ["cache_salt"]


def test_chat_limits() -> None:
    request = validated(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 3})
    assert request.token_limit() == 3 and request.messages[0].text() == "ab"


def test_json_body_errors() -> None:
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_json_body(b"{", "application/json")
    with pytest.raises(ApiError, match="Content-Type"):
        parse_json_body(b"{}", "application/x-www-form-urlencoded")
    assert parse_json_body(b'{"a": 1}', "application/json; charset=utf-8") == {"a": 1}


def test_error_envelope_and_sse_framing() -> None:
    error = ApiError(404, "nope", param="model", code="model_not_found")
    assert error.body() == {"error": {"message": "nope", "type": "not_found_error", "param": "model",
                                      "code": "model_not_found"}}
    assert sse.event({"a": "x\ny", "b": float("-inf")}) == b'data: {"a":"x\\ny","b":null}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"
