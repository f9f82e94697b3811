"""Helpers to run the runtime for tests: free ports, health waits, in-process uvicorn, SSE parsing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


HEALTH_BOUND_SECONDS = 1.0  # a kubelet probe's patience is 5 s; a loop held for 1 s is already a stall


class HealthWatch:
    """Polls /health while a request runs; `slowest` is the longest any answer took (or a failure's time)."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.failures += not ok
                self._stop.wait(0.05)


@contextmanager
def activator(tmp_path: Path, backend_port: int, *flags: str) -> Iterator[tuple[str, str]]:
    with activator_process(tmp_path, backend_port, *flags) as (url, metrics, _):
        yield url, metrics


@contextmanager
def activator_process(tmp_path: Path, backend_port: int, *flags: str
                      ) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """`tally-runtime activate` in its own process: its API URL, its metrics URL, and the process."""
    port, metrics = free_port(), free_port()
    log = tmp_path / f"activator-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tally_runtime", "activate", "--service", "team/chat",
                                 "--backend", f"http://127.0.0.1:{backend_port}", "--host", "127.0.0.1",
                                 "--port", str(port), "--metrics-port", str(metrics), *flags],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        wait_healthy(f"http://127.0.0.1:{metrics}", proc, log, deadline=60)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}", proc
    finally:
        terminate(proc)
