"""Usage truth and fault isolation with the real model behind engines that coalesce, fail or stay silent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from engine_wrappers import Coalescing, Crashing, FailingAfter, UsageBlind
from runtime_harness import metric_value, serving, sse_payloads

from tally_runtime.app import create_app
from tally_runtime.engine.llamacpp import LlamaCppEngine
from tally_runtime.settings import Settings

SETTINGS = Settings(max_concurrent_generations=4)


def app_with(wrap: Any) -> Any:
    return create_app(SETTINGS, wrap(LlamaCppEngine.from_config(SETTINGS.engine_config())))


@pytest.fixture(scope="module")
def coalescing() -> Iterator[str]:
    with serving(app_with(lambda e: Coalescing(e, 3))) as url:
        yield url


@pytest.fixture(scope="module")
def failing() -> Iterator[str]:
    with serving(app_with(lambda e: FailingAfter(e, 2, "FAIL"))) as url:
        yield url


def stream_events(url: str, **body: Any) -> list[Any]:
    response = httpx.post(f"{url}/v1/completions", json={"stream": True, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return sse_payloads(response.content)


def test_usage_is_engine_count_not_chunk_count(coalescing: str) -> None:
    events = stream_events(coalescing, prompt="The capital of France is", max_tokens=12, ignore_eos=True,
                           stream_options={"include_usage": True})
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12
    assert len(chunks) == 4  # 12 tokens in items of 3: a chunk counter would report 4
    metrics = httpx.get(f"{coalescing}/metrics").text
    assert metric_value(metrics, "tally_usage_mismatches_total") == 0


def test_coalesced_stream_equals_non_stream(coalescing: str) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    plain = httpx.post(f"{coalescing}/v1/completions", json=body, timeout=120).json()
    events = stream_events(coalescing, **body, stream_options={"include_usage": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == plain["choices"][0]["text"]
    assert events[-2]["usage"] == plain["usage"]


def test_itl_is_per_token_not_per_chunk(coalescing: str) -> None:
    before = metric_value(httpx.get(f"{coalescing}/metrics").text, "tally_inter_token_latency_seconds_count")
    stream_events(coalescing, prompt="Hi", max_tokens=9, ignore_eos=True)
    after = metric_value(httpx.get(f"{coalescing}/metrics").text, "tally_inter_token_latency_seconds_count")
    # 9 tokens in chunks of 3: the first chunk's wait is prefill (time to first token, as SGLang counts
    # it); each of the other 6 tokens gets its own observation (per chunk would be 2)
    assert after - before == 6


def test_t33_engine_fault_mid_stream_is_in_band(failing: str) -> None:
    events = stream_events(failing, prompt="FAIL now", max_tokens=8, ignore_eos=True)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "injected engine fault", "type": "server_error", "param": None,
                                    "code": 500}}
    assert all("error" not in e for e in events[:-2])
    client = openai.OpenAI(base_url=f"{failing}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="injected engine fault"):
        for _ in client.completions.create(model="smollm2-135m-instruct", prompt="FAIL again", max_tokens=8,
                                           extra_body={"ignore_eos": True}, stream=True):
            pass
    metrics = httpx.get(f"{failing}/metrics").text
    assert metric_value(metrics, "tally_requests_total", {"outcome": "error"}) >= 2
    assert httpx.get(f"{failing}/health").status_code == 200


def test_fault_does_not_leak_into_concurrent_streams(failing: str) -> None:
    results: dict[str, list[Any]] = {}

    def run(name: str, prompt: str) -> None:
        results[name] = stream_events(failing, prompt=prompt, max_tokens=8, ignore_eos=True, temperature=0)

    threads = [threading.Thread(target=run, args=(f"ok{i}", f"Healthy prompt {i}")) for i in range(2)]
    threads.append(threading.Thread(target=run, args=("bad", "FAIL here")))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert any("error" in e for e in results["bad"] if isinstance(e, dict))
    for name in ("ok0", "ok1"):
        events = results[name]
        assert all("error" not in e for e in events if isinstance(e, dict))
        assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
        assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_fault_before_first_byte_is_http_error() -> None:
    with serving(app_with(lambda e: FailingAfter(e, 0, "FAIL"))) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "FAIL", "max_tokens": 4, "stream": True},
                              timeout=60)
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "injected engine fault"


def test_derived_usage_is_counted() -> None:
    with serving(app_with(UsageBlind)) as url:
        body = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "ignore_eos": True},
                          timeout=60).json()
        assert body["usage"]["completion_tokens"] == 5
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_derived_usage_requests_total") == 1


@pytest.mark.parametrize(("after", "stream"), [pytest.param(0, True, id="at-prime-streamed"),
                                               pytest.param(0, False, id="at-prime-plain"),
                                               pytest.param(2, False, id="mid-generation-plain")])
def test_an_unexpected_engine_failure_is_still_the_openai_envelope(after: int, stream: bool) -> None:
    with serving(app_with(lambda e: Crashing(e, after, "CRASH"))) as url:
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"prompt": "CRASH", "max_tokens": 6, "ignore_eos": True, "stream": stream})
        assert response.status_code == 500 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["type"] == "server_error" and "unexpected engine failure" not in error["message"]
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200  # the server keeps serving


class TemplateFails:
    """The real engine, whose chat template raises for conversations with a developer message (a template
    that cannot render that role)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def render_chat(self, messages: Any, tools: Any = None) -> str:
        if any(m["role"] == "developer" for m in messages):
            raise RuntimeError("the template cannot render this conversation")
        return str(self.inner.render_chat(messages, tools))


def test_a_failure_while_preparing_is_a_500_envelope_recorded_once() -> None:
    with serving(app_with(TemplateFails)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "developer", "content": "Hi"}], "max_tokens": 2})
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
        assert "cannot render" not in response.text  # the engine's words stay in the log
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "tally_requests_total") == 1
        assert metric_value(metrics, "tally_requests_total", {"outcome": "error"}) == 1
        assert metric_value(metrics, "tally_prompt_tokens_total") == 0
