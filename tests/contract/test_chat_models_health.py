"""Chat streaming shape, /v1/models, /health (T35, T37, T38)."""

from __future__ import annotations

import httpx
import openai
from runtime_harness import sse_payloads

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def test_t35_chat_stream_role_content_finish_usage(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "stream": True,
                                                       "temperature": 0, "stream_options": {"include_usage": True}})
    events = sse_payloads(response.content)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]" and usage_chunk["choices"] == []
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    plain = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0}).json()
    assert plain["choices"][0]["message"]["content"] == text
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [plain["usage"][k] for k in counts] == [usage_chunk["usage"][k] for k in counts]
    # the same prompt again finds its cache: the CPU engine lends it the context that holds it (engine/slots.py)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_chat_with_sdk_and_logprobs(http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES,  # type: ignore[arg-type]
                                           max_completion_tokens=4, logprobs=True, top_logprobs=2, temperature=0)
    assert reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content or []
    assert len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(item.top_logprobs) <= 3 for item in content)


def test_t37_models(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "smollm2-135m-instruct" and card["object"] == "model"
    assert card["root"] == card["id"] and card["max_model_len"] == 2048  # the served name, never a path
    assert {"created", "owned_by"} <= set(card)
    assert http.get("/v1/models/smollm2-135m-instruct").status_code == 200
    missing = http.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_t38_health(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
