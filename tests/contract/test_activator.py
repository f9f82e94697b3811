"""The activator (`tally-runtime activate`) in front of a runtime that is not there yet, as a service scaled to
zero sees it: requests are held, the operator's long-poll hears of them at once, and once the real runtime
(CPU model) starts on the backend port every held stream is answered in full, billed by the runtime exactly
as the clients were told. Bounds: a full queue and a request held too long get the OpenAI 503 envelope with
Retry-After; a body too large, 413; a client that leaves while held leaves the queue."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from runtime_harness import activator, activator_process, free_port, metric_value, runtime_process, until

MODEL = "smollm2-135m-instruct"
STREAMS = 8


@contextmanager
def runtime_on(tmp_path: Path, port: int, *flags: str) -> Iterator[str]:
    """The real runtime on the port the activator forwards to, started only once requests are held."""
    with runtime_process(tmp_path / "runtime.log", *flags, port=port) as (_, url):
        yield url


def held(metrics: str) -> int:
    return int(metric_value(httpx.get(f"{metrics}/metrics").text, "tally_activator_held_requests"))


def test_held_streams_are_answered_in_full_once_a_pod_starts_and_billed_as_received(tmp_path: Path) -> None:
    backend = free_port()
    results: list[Any] = []
    failures: list[str] = []
    lock = threading.Lock()
    with activator(tmp_path, backend, "--hold-seconds", "180") as (url, metrics):
        def stream(i: int) -> None:
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=240)
            try:
                chunks = list(sdk.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=12,
                    stream=True, stream_options={"include_usage": True}))
            except openai.APIError as err:
                with lock:
                    failures.append(repr(err))
                return
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            with lock:
                results.append((text, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices]))

        # The operator's long-poll, started before anything is held, returns as soon as something is
        polled: list[dict[str, Any]] = []
        poll = threading.Thread(target=lambda: polled.append(httpx.get(f"{metrics}/held?wait=25", timeout=40).json()))
        poll.start()
        clients = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        started = time.monotonic()
        for client in clients:
            client.start()
        poll.join(timeout=40)
        assert polled and polled[0]["held"] >= 1
        assert time.monotonic() - started < 10, "the long-poll waited for its timeout instead of the first hold"
        assert until(lambda: held(metrics) == STREAMS, 30), held(metrics)
        with runtime_on(tmp_path, backend) as runtime:
            for client in clients:
                client.join(timeout=240)
            assert not failures, failures
            assert len(results) == STREAMS
            assert held(metrics) == 0
            page = httpx.get(f"{runtime}/metrics").text
            billed = (metric_value(page, "tally_prompt_tokens_total"),
                      metric_value(page, "tally_completion_tokens_total"))
        told = (sum(u.prompt_tokens for _, u, _ in results), sum(u.completion_tokens for _, u, _ in results))
        assert billed == told
        assert all(text and reasons[-1] in {"stop", "length"} for text, _, reasons in results)
        activator_page = httpx.get(f"{metrics}/metrics").text
        assert metric_value(activator_page, "tally_activator_requests_total", {"outcome": "forwarded"}) == STREAMS
        assert metric_value(activator_page, "tally_activator_cold_start_seconds_count") == STREAMS
        assert httpx.get(f"{metrics}/held").json()["lastColdStartSeconds"] > 0


def test_with_api_keys_more_held_requests_than_the_pods_per_address_limit_all_authenticate_there(
        tmp_path: Path) -> None:
    """Every forwarded request comes from the activator's one address, and a pod with keys holds at most 16
    connections from one address before they authenticate: 24 held requests still all go through, each
    checked by the pod (a wrong key is its 401, passed back as it is)."""
    keys = tmp_path / "keys"
    keys.write_text("acme sk-acme-0123456789abcdef\n")
    backend, held_count = free_port(), 24
    statuses: list[int] = []
    lock = threading.Lock()
    with activator(tmp_path, backend, "--hold-seconds", "120") as (url, metrics):
        def post(i: int) -> None:
            key = "sk-wrong-0123456789abcdef" if i == 0 else "sk-acme-0123456789abcdef"
            response = httpx.post(f"{url}/v1/completions", timeout=180, headers={"Authorization": f"Bearer {key}"},
                                  json={"model": MODEL, "prompt": f"Say {i}", "max_tokens": 2})
            with lock:
                statuses.append(response.status_code)

        clients = [threading.Thread(target=post, args=(i,)) for i in range(held_count)]
        for client in clients:
            client.start()
        assert until(lambda: held(metrics) == held_count, 30), held(metrics)
        with runtime_on(tmp_path, backend, "--api-keys-file", str(keys)) as runtime:
            for client in clients:
                client.join(timeout=180)
            page = httpx.get(f"{runtime}/metrics").text
    assert sorted(statuses) == [200] * (held_count - 1) + [401], statuses
    assert metric_value(page, "tally_tenant_requests_total", {"tenant": "acme"}) == held_count - 1


def test_a_request_held_past_its_time_gets_a_503_envelope_with_retry_after(tmp_path: Path) -> None:
    with activator(tmp_path, free_port(), "--hold-seconds", "1") as (url, _):
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
                              timeout=30)
        assert response.status_code == 503
        assert 1 <= time.monotonic() - started < 10
        error = response.json()["error"]
        assert error["code"] == "service_starting" and "not billed" in error["message"]
        assert int(response.headers["retry-after"]) >= 1
        with pytest.raises(openai.InternalServerError):  # the SDK sees an ordinary 503
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).completions.create(
                model=MODEL, prompt="Hi", max_tokens=4)


def test_a_stopping_activator_answers_its_held_requests_503_to_retry_never_500(tmp_path: Path) -> None:
    """Issue 63, item 4: a request held when the activator stopped got a 500 (uvicorn's graceful window ended
    with it still held, then the pod's client was closed under it). SIGTERM now answers every held request at
    once with a 503 to retry, which the SDKs retry (the Service then points at a pod, or the next activator)."""
    import signal

    with activator_process(tmp_path, free_port(), "--hold-seconds", "120") as (url, metrics, proc):
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60)))
            for _ in range(3)]
        for thread in threads:
            thread.start()
        assert until(lambda: held(metrics) == 3, 30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert len(answers) == 3 and time.monotonic() - started < 5  # within uvicorn's graceful window
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "shutting_down" and answer.headers["retry-after"] == "1"
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught once stopped


def test_a_full_queue_refuses_at_once_and_a_client_that_leaves_while_held_leaves_it(tmp_path: Path) -> None:
    with activator(tmp_path, free_port(), "--max-held", "2", "--hold-seconds", "120") as (url, metrics):
        leaving = [_send_held(url) for _ in range(2)]
        assert until(lambda: held(metrics) == 2, 30)
        started = time.monotonic()
        third = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=30)
        assert third.status_code == 503 and time.monotonic() - started < 5
        assert third.json()["error"]["code"] == "service_starting" and "retry-after" in third.headers
        for sock in leaving:  # the held clients hang up: their places are free again
            sock.close()
        assert until(lambda: held(metrics) == 0, 30), held(metrics)
        page = httpx.get(f"{metrics}/metrics").text
        assert metric_value(page, "tally_activator_requests_total", {"outcome": "gone"}) == 2
        assert metric_value(page, "tally_activator_requests_total", {"outcome": "overflow"}) == 1


def test_a_body_over_the_bound_is_a_413_and_nothing_is_held(tmp_path: Path) -> None:
    with activator(tmp_path, free_port(), "--max-body-bytes", "1024") as (url, metrics):
        response = httpx.post(f"{url}/v1/completions", content=b"x" * 4096, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert held(metrics) == 0


def _send_held(url: str) -> socket.socket:
    """A client that sends a whole request and waits (the test closes its socket to leave)."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "m", "prompt": "Hi"}'
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_behind_a_pool_the_pickers_scrapes_are_answered_here_and_count_what_is_held(tmp_path: Path) -> None:
    """With --model-server-metrics the picker's scrape of the API port's /metrics is answered at once with its
    gauges (what is held is the queue) and is never held itself: a picker scraping a service at zero never
    wakes it. Without the flag the same GET is an ordinary request, held like any other."""
    flags = ("--model-server-metrics", "--served-model-name", MODEL, "--max-held", "4", "--hold-seconds", "120")
    gauge = {"model_name": MODEL}
    with activator(tmp_path, free_port(), *flags) as (url, metrics):
        for _ in range(20):  # a picker scrapes many times a second
            page = httpx.get(f"{url}/metrics", timeout=5)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
            assert metric_value(page.text, "sglang:num_queue_reqs", gauge) == 0
        assert held(metrics) == 0 and "tally_" not in page.text
        leaving = [_send_held(url) for _ in range(3)]
        assert until(lambda: metric_value(httpx.get(f"{url}/metrics").text, "sglang:num_queue_reqs", gauge) == 3, 30)
        page = httpx.get(f"{url}/metrics").text
        assert metric_value(page, "sglang:num_running_reqs", gauge) == 0 == metric_value(page, "sglang:token_usage",
                                                                                           gauge)
        assert 'sglang:cache_config_info{model_name="smollm2-135m-instruct",page_size="1",num_pages="0"} 1.0' in page
        assert held(metrics) == 3
        for sock in leaving:
            sock.close()
        assert until(lambda: held(metrics) == 0, 30)
    with activator(tmp_path, free_port(), "--hold-seconds", "1") as (url, _):
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 503  # held, then timed out: not answered


def test_behind_a_pool_a_stream_being_relayed_counts_as_running_until_it_ends(tmp_path: Path) -> None:
    """Once a pod answers, what the activator relays is the picker's `num_running_reqs`, not its queue: one
    stream read halfway counts 1, and 0 again once its client has gone."""
    gauge = {"model_name": MODEL}
    backend = free_port()
    with runtime_on(tmp_path, backend) as _, activator(tmp_path, backend, "--model-server-metrics",
                                                       "--served-model-name", MODEL) as (url, _metrics):
        def gauges() -> tuple[float, float]:
            page = httpx.get(f"{url}/metrics", timeout=5).text
            return (metric_value(page, "sglang:num_running_reqs", gauge),
                    metric_value(page, "sglang:num_queue_reqs", gauge))

        assert gauges() == (0, 0)
        with httpx.Client(timeout=120) as http, http.stream(
                "POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": "Count:", "max_tokens": 400,
                                                       "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # kept: a dropped iterator closes the response (the client leaves)
            assert next(chunks).startswith(b"data: ")
            assert gauges() == (1, 0)  # mid-stream: relayed, not held
        assert until(lambda: gauges() == (0, 0), 30), gauges()


# ---- bounds: the activator faces every client unauthenticated, so it has the runtime's (hostile input, round 5)

def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (what it sent before closing is skipped)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _activator_pid(url: str) -> int:
    """The activator process listening on `url`'s port (this test's child)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] == "0A"}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            except OSError:
                continue
            if any(f"socket:[{inode}]" in links for inode in inodes):
                return int(proc.name)
    raise AssertionError(f"no process listens on {port}")


def test_half_sent_heads_are_closed_within_the_head_deadline(tmp_path: Path) -> None:
    """300 connections that never finish their request head once stayed open 35 s and more; now the head
    deadline (10 s) closes each, and the metrics port answers meanwhile."""
    with activator(tmp_path, free_port()) as (url, metrics):
        trickling = [_raw(url) for _ in range(60)]
        for sock in trickling:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert httpx.get(f"{metrics}/health", timeout=5).status_code == 200
        assert until(lambda: all(_closed(s) for s in trickling), 25), "half-sent heads were kept open"
        for sock in trickling:
            sock.close()


def test_unfinished_bodies_cannot_take_the_activators_memory(tmp_path: Path) -> None:
    """60 never-finished 4 MiB bodies took the activator from 49 to 300 MiB (bodies were read whole before the
    queue's bound): now a request takes a slot before its body is read, so beyond --max-held the rest are refused
    at once and nothing of theirs is read."""
    with activator(tmp_path, free_port(), "--max-held", "4", "--hold-seconds", "120") as (url, _):
        pid = _activator_pid(url)
        before = _rss_kib(pid)
        chunk = b"x" * (1 << 20)
        socks, refused = [], 0
        for _ in range(60):
            sock = _raw(url)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(4 << 20).encode() + b"\r\n\r\n")
            try:
                for _ in range(3):  # 3 MiB of the 4 promised, then nothing more
                    sock.sendall(chunk)
            except OSError:
                pass  # refused and closed while sending
            socks.append(sock)
        for sock in socks:
            sock.settimeout(5)
            with contextlib.suppress(OSError):
                refused += sock.recv(64).startswith(b"HTTP/1.1 503")
        grown_mib = (_rss_kib(pid) - before) / 1024
        for sock in socks:
            sock.close()
    assert refused >= 56, f"only {refused} of 60 refused with at most 4 in hand"
    assert grown_mib < 4 * 3 * 2 + 16, f"the activator grew {grown_mib:.0f} MiB"


def test_a_declared_body_over_the_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with activator(tmp_path, free_port(), "--max-body-bytes", "1024") as (url, _):
        sock = _raw(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(64).startswith(b"HTTP/1.1 413")  # no byte of the body was sent
        sock.close()


def test_one_address_holds_at_most_its_share_of_connections(tmp_path: Path) -> None:
    with activator(tmp_path, free_port(), "--max-connections-per-client", "8") as (url, metrics):
        kept = [_raw(url) for _ in range(8)]
        extra = _raw(url)
        extra.settimeout(10)
        assert extra.recv(64).startswith(b"HTTP/1.1 429")
        assert httpx.get(f"{metrics}/health", timeout=5).status_code == 200  # the probes' port is apart
        for sock in [*kept, extra]:
            sock.close()


def test_idle_connections_from_one_address_cannot_keep_the_probes_out(tmp_path: Path) -> None:
    """16 idle connections from one address (its metrics port's places) made /health and /held answer 503 for 50 s
    and more: a probe or the operator's long-poll now takes the place of a connection idle for a second."""
    with activator(tmp_path, free_port()) as (_, metrics):
        idle = [_raw(metrics) for _ in range(16)]
        try:
            assert until(lambda: httpx.get(f"{metrics}/health", timeout=5).status_code == 200, 5)
            assert httpx.get(f"{metrics}/held", timeout=5).status_code == 200
        finally:
            for sock in idle:
                sock.close()


def test_forwarded_responses_close_their_connection_so_pooled_clients_leave(tmp_path: Path) -> None:
    """Pooled clients stayed on the activator after the pod was up (a keep-alive connection, never closed): every
    response it forwards now says `Connection: close`, so the next request opens a new connection through the
    Service, which points at the pods by then."""
    backend = free_port()
    with runtime_on(tmp_path, backend) as _, activator(tmp_path, backend) as (url, _):
        opened: list[object] = []
        with httpx.Client(timeout=60, event_hooks={"request": [lambda r: opened.append(r)]}) as client:
            for _ in range(3):
                response = client.post(f"{url}/v1/completions",
                                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                assert response.status_code == 200 and response.headers["connection"] == "close"
            pool = client._transport._pool  # type: ignore[attr-defined]
            assert len(pool.connections) == 0, "a forwarded response's connection was kept for reuse"


def test_a_request_target_that_is_no_path_is_a_400(tmp_path: Path) -> None:
    """The fuzzer's finding: `GET *` made a backend URL httpx refuses, and the activator answered 500."""
    with activator(tmp_path, free_port()) as (url, _):
        sock = _raw(url)
        sock.sendall(b"GET * HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(64).startswith(b"HTTP/1.1 400")
        sock.close()
