"""A billing system's ingest endpoint for the record delivery tests, and what clients were told."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

TOKEN = "meter-token-0123456789"


class Receiver:
    """An ingest endpoint: takes CloudEvents batches with the right token, unless told to fail."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.posts = 0
        self.failing = False
        self.latency = 0.0  # seconds each POST takes before it is answered
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.latency:
                    time.sleep(receiver.latency)
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


def receiving() -> Iterator[Receiver]:
    """A receiver for a test (the `receiver` fixture, tests/contract/conftest.py)."""
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


def serve(url: str, count: int) -> list[dict[str, int]]:
    with httpx.Client(base_url=url, timeout=60) as http:
        return [http.post("/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 4}).json()["usage"]
                for i in range(count)]


def told(usages: list[dict[str, int]]) -> tuple[int, int, int]:
    return len(usages), sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
