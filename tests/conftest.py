"""Shared fixtures: a real `tally-runtime serve` process on loopback, and in-process apps for fault injection."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from runtime_harness import free_port, terminate, wait_healthy


@pytest.fixture(scope="session")
def runtime_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The CPU runtime as a user runs it: a subprocess bound to 127.0.0.1."""
    port = free_port()
    log = tmp_path_factory.mktemp("runtime") / "runtime.log"
    env = {**os.environ, "TALLY_MAX_CONCURRENT_GENERATIONS": "4"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tally_runtime", "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, deadline=120)
        yield url
    finally:
        terminate(proc)


@pytest.fixture
def http(runtime_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_url, timeout=120) as client:
        yield client
