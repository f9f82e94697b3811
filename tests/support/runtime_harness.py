"""Helpers to run the runtime for tests: free ports, health waits, in-process uvicorn, SSE parsing."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

from tally_runtime.settings import KEEP_ALIVE_SECONDS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, log: Path | None, deadline: float) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"runtime exited with {proc.returncode}:\n{log.read_text() if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {deadline}s")


@contextmanager
def serving(app: Any, health: int = 200) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn on 127.0.0.1 in a thread (ASGITransport buffers streams).

    Yields once /health answers `health` (503 for an engine that is refused at start-up)."""
    port = free_port()
    # the runtime's idle keep-alive, not uvicorn's 5 s (which equals httpx's and resets a pooled request now and then)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if health == 200:
            wait_healthy(url, None, None, deadline=120)
        elif not until(lambda: _status(url) == health, 120):
            raise TimeoutError(f"{url}/health never answered {health}")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def sse_payloads(body: bytes) -> list[Any]:
    """Split a raw SSE body into payloads; '[DONE]' stays a string."""
    events = body.split(b"\n\n")
    assert events[-1] == b"", "body must end with a blank line"
    out: list[Any] = []
    for event in events[:-1]:
        assert event.startswith(b"data: "), event
        data = event[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def until(predicate: Callable[[], bool], deadline: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextmanager
def runtime_process(log: Path, *args: str, port: int = 0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`tally-runtime serve` (CPU engine) as a user runs it, with extra flags, on `port` (0: a free one);
    stopped afterwards."""
    import os
    import sys

    port = port or free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tally_runtime", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, deadline=120)
        yield proc, url
    finally:
        terminate(proc)


def terminate(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited by `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
