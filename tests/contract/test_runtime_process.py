"""Admission queueing, the SIGTERM drain and the counter journal, on real `tally-runtime serve` processes."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import signal
from pathlib import Path

import httpx
import openai
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from runtime_harness import metric_value, runtime_process, sse_payloads, until

from tally_runtime.ledger import Journal

LONG = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}


def test_six_sdk_streams_on_four_slots_all_finish(runtime_url: str) -> None:
    """Every benchmark client at concurrency > capacity lost requests while they were refused."""
    client = openai.OpenAI(base_url=f"{runtime_url}/v1", api_key="unused", max_retries=0)

    def one(i: int) -> tuple[str, int]:
        chunks = list(client.completions.create(model="smollm2-135m-instruct", prompt=f"Story {i}:", max_tokens=12,
                                                 extra_body={"ignore_eos": True}, stream=True,
                                                 stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None
        return "".join(c.choices[0].text for c in chunks if c.choices), usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert [tokens for _, tokens in results] == [12] * 6


def test_queue_bounds_give_503_with_retry_after(tmp_path: Path) -> None:
    with runtime_process(tmp_path / "rt.log", "--max-concurrent-generations", "1", "--max-queued-requests", "1",
                         "--max-queue-seconds", "2") as (_, url), httpx.Client(base_url=url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=LONG) as hog, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        lines = hog.iter_lines()
        next(lines)
        queued = pool.submit(http.post, "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert until(lambda: metric_value(http.get("/metrics").text, "tally_queued_requests") == 1, 10)
        full = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "overloaded"
        timed_out = queued.result(timeout=30)  # the hog holds the only slot longer than the queue wait
        assert timed_out.status_code == 503 and "within 2s" in timed_out.json()["error"]["message"]
        metrics = http.get("/metrics").text
        assert metric_value(metrics, "tally_requests_total", {"outcome": "overloaded"}) == 2
        assert metric_value(metrics, "tally_queued_requests") == 0


def acknowledgement(metrics: str) -> dict[str, float]:
    """What the operator posts back once it booked a drained runtime's final counters."""
    return {"epoch": metric_value(metrics, "tally_start_time_seconds"),
            "requests": metric_value(metrics, "tally_requests_total"),
            "promptTokens": metric_value(metrics, "tally_prompt_tokens_total"),
            "completionTokens": metric_value(metrics, "tally_completion_tokens_total"),
            "cachedTokens": metric_value(metrics, "tally_cached_tokens_total")}


def test_sigterm_drains_in_flight_streams_and_only_the_operators_acknowledgement_ends_it(tmp_path: Path) -> None:
    with runtime_process(tmp_path / "rt.log", "--final-read-seconds", "60") as (proc, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 40,
                                                          "stream_options": {"include_usage": True}}) as inflight:
            body = iter(inflight.iter_bytes())
            received = [next(body)]
            assert http.post("/internal/final-read", json={}).status_code == 409  # not draining yet
            proc.send_signal(signal.SIGTERM)
            # New connections from here: the drain closes the client's idle pooled one (test_connections.py)
            assert until(lambda: httpx.get(f"{url}/health").status_code == 503, 10)
            assert httpx.get(f"{url}/health").json()["status"] == "draining"
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            received.extend(body)
        events = sse_payloads(b"".join(received))
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 40
        final = http.get("/metrics").text
        for _ in range(20):  # a Prometheus, kubectl or a curious client reading /metrics ends nothing
            http.get("/metrics")
        assert metric_value(final, "tally_requests_total", {"outcome": "ok"}) == 1
        assert metric_value(final, "tally_completion_tokens_total") == 40
        wrong = {**acknowledgement(final), "completionTokens": 39}
        assert http.post("/internal/final-read", json=wrong).status_code == 409
        assert http.post("/internal/final-read", content=b"[" * 10_000).status_code == 413  # bounded
        assert http.post("/internal/final-read", content=b"[1]").status_code == 400
        assert proc.poll() is None  # drained, still waiting for its counters to be booked
        assert http.post("/internal/final-read", json=acknowledgement(final)).status_code == 200
        assert proc.wait(timeout=30) == 0


def test_a_drain_past_its_deadline_aborts_what_runs_and_still_waits_for_the_final_read(tmp_path: Path) -> None:
    """The final read has a budget of its own: a drain that ends late does not leave the operator 0 s."""
    with runtime_process(tmp_path / "rt.log", "--drain-seconds", "1", "--final-read-seconds", "60") as (proc, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 2000}) as inflight:
            body = iter(inflight.iter_bytes())
            received = [next(body)]
            proc.send_signal(signal.SIGTERM)
            received.extend(body)  # cut at the deadline: an error event, then [DONE]
        events = sse_payloads(b"".join(received))
        assert events[-1] == "[DONE]" and "error" in events[-2]
        streamed = sum(1 for e in events if isinstance(e, dict) and e.get("choices"))
        final = http.get("/metrics").text
        assert metric_value(final, "tally_requests_total", {"outcome": "error"}) == 1
        assert metric_value(final, "tally_completion_tokens_total") >= streamed  # what the engine generated
        assert not until(lambda: proc.poll() is not None, 3)  # well past the drain deadline, still waiting
        assert http.post("/internal/final-read", json=acknowledgement(final)).status_code == 200
        assert proc.wait(timeout=30) == 0


def signed(key: Ed25519PrivateKey, body: dict[str, object]) -> tuple[bytes, dict[str, str]]:
    """A final-read call as the operator makes it (reconcile.signed): the exact bytes, their signature."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return raw, {"X-Tally-Signature": base64.b64encode(key.sign(raw)).decode(), "Content-Type": "application/json"}


def public(key: Ed25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def test_only_an_acknowledgement_signed_by_the_operator_ends_the_drain(tmp_path: Path) -> None:
    """Anyone who reaches the metrics port can read the final counters; only the operator's key can sign them
    back. The drain of an idle pod leaves most of its budget: the final read may use it."""
    operator, forger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--final-read-key", public(operator), "--pod-uid", "pod-a",
                         "--drain-seconds", "60", "--final-read-seconds", "1") as (proc, url), \
            httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        # a new connection per call: the drain closes idle pooled ones (test_connections.py)
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert until(lambda: metric_value(http.get("/metrics").text, "tally_draining") == 1, 10)
        final = {**acknowledgement(http.get("/metrics").text), "podUid": "pod-a"}
        assert http.post("/internal/final-read", json=final).status_code == 403  # read and posted back: forged
        for body, headers in (signed(forger, final), signed(operator, {**final, "podUid": "pod-b"}),
                              signed(forger, {"podUid": "pod-a", "release": True})):
            refused = http.post("/internal/final-read", content=body, headers=headers)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        body, headers = signed(operator, final)
        assert http.post("/internal/final-read", content=body + b" ", headers=headers).status_code == 403
        assert not until(lambda: proc.poll() is not None, 3)  # past --final-read-seconds: the drain's time is left
        assert http.post("/internal/final-read", content=body, headers=headers).status_code == 200
        assert proc.wait(timeout=30) == 0


def test_a_signed_release_ends_the_wait_of_a_pod_whose_service_is_gone(tmp_path: Path) -> None:
    """A release names the drain it ends: the pod's epoch and the nonce it made when its drain began (read from
    it just before). One signed without them, or for another drain, is refused: a release read off the
    plaintext metrics port once could otherwise end this pod's wait at any later drain."""
    operator = Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--final-read-key", public(operator), "--pod-uid", "pod-a",
                         "--final-read-seconds", "120") as (proc, url), \
            httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        assert http.get("/internal/final-read").status_code == 409  # not draining: nothing to release
        early, early_headers = signed(operator, {"podUid": "pod-a", "release": True, "epoch": 0, "nonce": "x"})
        assert http.post("/internal/final-read", content=early, headers=early_headers).status_code == 409
        proc.send_signal(signal.SIGTERM)
        assert until(lambda: metric_value(http.get("/metrics").text, "tally_draining") == 1, 10)
        challenge = http.get("/internal/final-read").json()
        assert challenge["podUid"] == "pod-a" and len(challenge["nonce"]) == 32
        for stale in ({"podUid": "pod-a", "release": True},  # the old message: no epoch, no nonce
                      {"podUid": "pod-a", "release": True, "epoch": challenge["epoch"], "nonce": "0" * 32},
                      {"podUid": "pod-a", "release": True, "epoch": challenge["epoch"] + 1,
                       "nonce": challenge["nonce"]}):
            body, headers = signed(operator, stale)
            refused = http.post("/internal/final-read", content=body, headers=headers)
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_this_drain"
        assert proc.poll() is None
        body, headers = signed(operator, {"podUid": "pod-a", "release": True, **{
            k: challenge[k] for k in ("epoch", "nonce")}})
        assert http.post("/internal/final-read", content=body, headers=headers).status_code == 200
        assert proc.wait(timeout=30) == 0


def test_sigterm_on_an_idle_runtime_exits_at_once(tmp_path: Path) -> None:
    with runtime_process(tmp_path / "rt.log") as (proc, _):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_crashed_runtime_continues_its_counters_from_the_journal(tmp_path: Path) -> None:
    journal = tmp_path / "ledger" / "usage.json"
    journal.parent.mkdir()
    usages = []
    with runtime_process(tmp_path / "first.log", "--journal-path", str(journal)) as (proc, url):
        with httpx.Client(base_url=url, timeout=60) as http:
            for body in ({"prompt": "One", "max_tokens": 5},
                         {"prompt": "Two", "max_tokens": 3, "n": 2, "stream": True,
                          "stream_options": {"include_usage": True}}):
                response = http.post("/v1/completions", json=body)
                usages.append(sse_payloads(response.content)[-2]["usage"] if body.get("stream")
                              else response.json()["usage"])
            before = http.get("/metrics").text
        proc.kill()  # a crash: no drain, no goodbye
        proc.wait(timeout=30)
    with runtime_process(tmp_path / "second.log", "--journal-path", str(journal)) as (_, url):
        after = httpx.get(f"{url}/metrics").text
    for name in ("tally_prompt_tokens_total", "tally_completion_tokens_total", "tally_start_time_seconds"):
        assert metric_value(after, name) == metric_value(before, name), name
    assert metric_value(after, "tally_completion_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert metric_value(after, "tally_requests_total", {"outcome": "ok"}) == 2


def test_an_unreadable_journal_starts_the_counters_afresh(tmp_path: Path) -> None:
    journal = tmp_path / "usage.json"
    journal.write_text("{not json")
    with runtime_process(tmp_path / "rt.log", "--journal-path", str(journal)) as (_, url):
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "tally_requests_total") == 0
        assert metric_value(metrics, "tally_journal_healthy") == 1
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    loaded = Journal(journal).load()  # the unreadable bytes were written over, not continued from
    assert loaded is not None and sum(loaded.requests.values()) == 1


def test_a_restart_before_the_first_request_keeps_the_epoch(tmp_path: Path) -> None:
    journal = tmp_path / "usage.json"
    with runtime_process(tmp_path / "first.log", "--journal-path", str(journal)) as (proc, url):
        epoch = metric_value(httpx.get(f"{url}/metrics").text, "tally_start_time_seconds")
        proc.kill()
        proc.wait(timeout=30)
    with runtime_process(tmp_path / "second.log", "--journal-path", str(journal)) as (_, url):
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_start_time_seconds") == epoch
