"""Bad input gets its documented status and OpenAI error object, before any byte; the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

OK = {"prompt": "Hi", "max_tokens": 2}


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.mark.parametrize(("body", "param"), [
    pytest.param({"max_tokens": 2}, "prompt", id="missing-prompt"),
    pytest.param({**OK, "max_tokens": -1}, "max_tokens", id="negative-max-tokens"),
    pytest.param({**OK, "logprobs": 6}, "logprobs", id="logprobs-too-many"),
    pytest.param({**OK, "logprobs": -2}, "logprobs", id="logprobs-negative"),
    pytest.param({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", id="five-stops"),
    pytest.param({**OK, "temperature": 3}, "temperature", id="temperature"),
    pytest.param({**OK, "n": 0}, "n", id="n-zero"),
    pytest.param({**OK, "stream_options": {"include_usage": True}}, "stream_options", id="t20-options-no-stream"),
    pytest.param({**OK, "stream": True, "best_of": 2}, "best_of", id="t27-best-of-stream"),
    pytest.param({**OK, "best_of": 1, "n": 2}, "best_of", id="t27-best-of-below-n"),
    pytest.param({"prompt": "", "max_tokens": 2}, "prompt", id="empty-prompt"),
    pytest.param({"prompt": [], "max_tokens": 2}, "prompt", id="empty-list"),
    pytest.param({"prompt": [10**9], "max_tokens": 2}, "prompt", id="token-out-of-range"),
    pytest.param({**OK, "max_tokens": 5000}, "prompt", id="t32-context-exceeded"),
    pytest.param({**OK, "n": 5}, "n", id="more-choices-than-slots"),
])
def test_t30_bad_completion_requests(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    response = http.post("/v1/completions", json={**body, "stream": body.get("stream", False)}
                         if "stream_options" not in body else body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param
    assert response.headers["content-type"].startswith("application/json")


def test_t32_context_exceeded_on_stream_is_not_a_200(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5000, "stream": True})
    assert response.status_code == 400
    assert error_of(response)["code"] == "context_length_exceeded"


def test_malformed_json_and_content_type(http: httpx.Client) -> None:
    bad = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in error_of(bad)["message"]
    form = http.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert form.status_code == 400 and "Content-Type" in error_of(form)["message"]
    array = http.post("/v1/completions", json=[1, 2])
    assert array.status_code == 400


def test_t31_unknown_model_is_404(http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-17", prompt="Hi", max_tokens=1)
    assert caught.value.code == "model_not_found"
    chat = http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 404


def test_bad_chat_requests(http: httpx.Client) -> None:
    assert error_of(http.post("/v1/chat/completions", json={"messages": []}))["param"] == "messages"
    bad_role = http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert error_of(bad_role)["param"].startswith("messages.0.role")


def test_server_still_serves_after_bad_input(http: httpx.Client) -> None:
    for _ in range(3):
        http.post("/v1/completions", content=b"{{{", headers={"content-type": "application/json"})
    assert http.post("/v1/completions", json=OK).status_code == 200
    assert http.get("/health").status_code == 200
