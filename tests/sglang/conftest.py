"""Real SGLang 0.5.23 on the CPU (its own venv, hack/sglang/env.sh): servers for the tests in this folder."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator

import pytest

try:  # the real distribution, not the contract fake other test folders put on the path
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("real SGLang runs in its own venv: make test-sglang", allow_module_level=True)

from runtime_harness import free_port, wait_healthy
from sglang_harness import ENGINE_ARG_FLAGS, MODEL, start, stop


@pytest.fixture(scope="session")
def sglang_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tally-runtime serve --engine sglang` exactly as a user runs it, with the real engine."""
    port = free_port()
    log = tmp_path_factory.mktemp("sglang") / "runtime.log"
    proc, _ = start([sys.executable, "-m", "tally_runtime", "serve", "--engine", "sglang", "--port", str(port),
                     "--model-path", str(MODEL), "--max-concurrent-generations", "8",
                     *ENGINE_ARG_FLAGS], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, deadline=300)
        yield url
    finally:
        stop(proc)
