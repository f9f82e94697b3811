"""Usage records delivered to a billing system (delivery.py) by real `tally-runtime serve` processes: a
receiver that fails, a runtime SIGKILLed with records spooled, a drain that flushes. At least once: the
receiver deduplicates by event id, as OpenMeter does, and then holds exactly what the clients were told."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from runtime_harness import metric_value, runtime_process, until

TOKEN = "meter-token-0123456789"


class Receiver:
    """An ingest endpoint: takes CloudEvents batches with the right token, unless told to fail."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.posts = 0
        self.failing = False
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.posts += 1
                    ok = (not receiver.failing and self.headers["Authorization"] == f"Bearer {TOKEN}"
                          and self.headers["Content-Type"] == "application/cloudevents-batch+json")
                    if ok:
                        for event in json.loads(body):
                            receiver.events[event["id"]] = event  # deduplicated by id
                self.send_response(202 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/events"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def usage(self) -> tuple[int, int, int]:
        with self.lock:
            data = [e["data"] for e in self.events.values()]
        return len(data), sum(d["prompt_tokens"] for d in data), sum(d["completion_tokens"] for d in data)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


def serve(url: str, count: int) -> list[dict[str, int]]:
    with httpx.Client(base_url=url, timeout=60) as http:
        return [http.post("/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 4}).json()["usage"]
                for i in range(count)]


def told(usages: list[dict[str, int]]) -> tuple[int, int, int]:
    return len(usages), sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)


def test_records_reach_the_receiver_exactly_once_through_failures_a_crash_and_a_drain(
        tmp_path: Path, receiver: Receiver) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    flags = ("--usage-records-url", receiver.url, "--usage-records-token-file", str(token), "--journal-path",
             str(tmp_path / "ledger" / "usage.json"), "--usage-source", "/namespaces/a/completionservices/s/pods/p")
    (tmp_path / "ledger").mkdir()
    sent: list[dict[str, int]] = []
    with runtime_process(tmp_path / "first.log", *flags) as (proc, url):
        receiver.failing = True  # the billing system is down: records wait in the spool, retried
        sent += serve(url, 4)
        assert until(lambda: receiver.posts >= 2, 30)
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_usage_records_queued") == 4
        proc.send_signal(signal.SIGKILL)  # with 4 records undelivered
        proc.wait(timeout=30)
    receiver.failing = False
    with runtime_process(tmp_path / "second.log", *flags) as (proc, url):
        assert until(lambda: receiver.usage() == told(sent), 30), (receiver.usage(), told(sent))
        sent += serve(url, 3)
        proc.send_signal(signal.SIGTERM)  # the drain delivers what is spooled before the pod goes
        assert proc.wait(timeout=60) == 0
    assert receiver.usage() == told(sent)
    event = next(iter(receiver.events.values()))
    assert event["type"] == "dev.tally.usage.v1" and event["source"] == "/namespaces/a/completionservices/s/pods/p"
    assert event["data"]["schema"] == "tally.usage.v1"


def test_a_spool_that_is_full_counts_what_it_cannot_hold_lost(tmp_path: Path, receiver: Receiver) -> None:
    receiver.failing = True
    with runtime_process(tmp_path / "rt.log", "--usage-records-url", receiver.url, "--usage-records-spool",
                         str(tmp_path / "spool"), "--usage-records-spool-bytes", "4096") as (_, url):
        serve(url, 12)  # each record is about 600 bytes as a CloudEvent: 6 or so fit
        metrics = httpx.get(f"{url}/metrics").text
        queued = metric_value(metrics, "tally_usage_records_queued")
        lost = metric_value(metrics, "tally_usage_records_lost_total", {"sink": "delivery"})
        assert 0 < queued < 12 and queued + lost == 12
