"""/metrics moves as documented; disconnects abort generation; beyond capacity requests queue (T34, T39-T42)."""

from __future__ import annotations

import socket

import httpx
from runtime_harness import metric_value, sse_payloads, until

INFLIGHT = "tally_inflight_generations"
LONG = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}


def scrape(http: httpx.Client) -> str:
    response = http.get("/metrics")
    assert response.status_code == 200
    return response.text


def idle(http: httpx.Client) -> bool:
    return until(lambda: metric_value(scrape(http), INFLIGHT) == 0, deadline=10)


def test_every_series_is_present(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    text = scrape(http)
    for name in ("tally_requests_total", "tally_prompt_tokens_total", "tally_completion_tokens_total",
                 "tally_cached_tokens_total", "tally_usage_mismatches_total", "tally_derived_usage_requests_total",
                 "tally_stream_mode", "tally_inflight_generations", "tally_time_to_first_token_seconds_count",
                 "tally_inter_token_latency_seconds_count", "tally_e2e_request_latency_seconds_count",
                 "tally_engine_healthy"):
        assert f"\n{name}" in text, name
    assert metric_value(text, "tally_stream_mode", {"mode": "incremental"}) == 1
    assert metric_value(text, "tally_engine_healthy") == 1


def test_t39_counters_match_usage(http: httpx.Client) -> None:
    assert idle(http)
    before = scrape(http)
    usages = []
    for body in ({"prompt": "One", "max_tokens": 5},
                 {"prompt": ["Two", "Three"], "max_tokens": 3, "n": 2},
                 {"prompt": "Four", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}):
        response = http.post("/v1/completions", json=body)
        usages.append(sse_payloads(response.content)[-2]["usage"] if body.get("stream") else response.json()["usage"])
    after = scrape(http)

    def delta(name: str, labels: dict[str, str] | None = None) -> float:
        return metric_value(after, name, labels) - metric_value(before, name, labels)

    assert delta("tally_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("tally_completion_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("tally_requests_total", {"endpoint": "completions", "outcome": "ok"}) == 3
    assert delta("tally_usage_mismatches_total") == 0
    assert delta("tally_derived_usage_requests_total") == 0
    generated = sum(u["completion_tokens"] for u in usages)
    # 6 choices: a choice's first batch (usually one token) has no inter-token gap, only time to first token
    assert generated // 2 <= delta("tally_inter_token_latency_seconds_count") <= generated - 6


def test_invalid_requests_are_counted(http: httpx.Client) -> None:
    before = metric_value(scrape(http), "tally_requests_total", {"outcome": "invalid"})
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
    assert metric_value(scrape(http), "tally_requests_total", {"outcome": "invalid"}) == before + 1


def test_t40_disconnect_mid_stream_aborts(http: httpx.Client) -> None:
    assert idle(http)
    before = scrape(http)
    with http.stream("POST", "/v1/completions", json=LONG) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric_value(scrape(http), INFLIGHT) == 1
    assert idle(http), "generation kept running after the client left"
    after = scrape(http)
    aborted = {"outcome": "aborted"}
    assert metric_value(after, "tally_requests_total", aborted) == metric_value(before, "tally_requests_total",
                                                                                aborted) + 1
    # usage is still recorded for the aborted request, and far below what max_tokens would have produced
    produced = metric_value(after, "tally_completion_tokens_total") - metric_value(before,
                                                                                   "tally_completion_tokens_total")
    assert 1 <= produced < 400


def test_t41_disconnect_non_stream_aborts(http: httpx.Client, runtime_url: str) -> None:
    assert idle(http)
    host, port = runtime_url.removeprefix("http://").split(":")
    body = b'{"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": true}'
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert until(lambda: metric_value(scrape(http), INFLIGHT) == 1, deadline=10)
    assert idle(http)


def test_t34_beyond_capacity_a_request_waits_its_turn(http: httpx.Client, runtime_url: str) -> None:
    assert idle(http)
    with http.stream("POST", "/v1/completions", json={**LONG, "n": 4}) as hog:
        lines = hog.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)
        with httpx.Client(base_url=runtime_url, timeout=120) as other:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(other.post, "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                assert until(lambda: metric_value(scrape(http), "tally_queued_requests") == 1, deadline=10)
                assert not waiting.done()
                hog.close()  # the hog leaves: the queued request is admitted
                assert waiting.result(timeout=60).status_code == 200
    assert idle(http)


def test_t42_completed_stream_is_not_aborted(http: httpx.Client) -> None:
    before = metric_value(scrape(http), "tally_requests_total", {"outcome": "aborted"})
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert idle(http)
    assert metric_value(scrape(http), "tally_requests_total", {"outcome": "aborted"}) == before
