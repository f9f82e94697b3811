"""The operator's scrape against hostile pods on loopback: a gzip body that would inflate far past the cap, a
body past the cap as sent, and a pod that answers slowly, each the pod's own failure."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Iterator
from typing import Any

import pytest
from runtime_harness import serving

from tally_operator.scrape import MAX_METRICS_BYTES, scrape

INFLATED = 64 << 20  # what the review's 255 KiB gzip body became: far past the 4 MiB cap
seen: list[dict[str, str]] = []


async def hostile(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app: /gzip sends a gzip body whatever was asked for; /big sends 5 MiB as it is."""
    if scope["type"] != "http":
        return
    seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
    if scope["path"] == "/health":
        body, headers = b"ok", []
    elif scope["path"] == "/gzip":
        body, headers = gzip.compress(b"0" * INFLATED, 9), [(b"content-encoding", b"gzip")]
    else:
        body, headers = b"# x\n" * ((5 << 20) // 4), []
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), *headers]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(hostile) as base:
        yield base


def test_a_gzip_body_is_refused_and_never_inflated(url: str) -> None:
    """httpx used to decompress before the size check: one pod's small gzip body cost the operator 134 MiB."""
    result = asyncio.run(scrape({"pod": f"{url}/gzip"}, 4, 10))["pod"]
    assert isinstance(result, Exception) and "encoded" in str(result)
    assert seen[-1].get("accept-encoding") == "identity"


def test_a_body_past_the_cap_as_sent_is_refused(url: str) -> None:
    result = asyncio.run(scrape({"pod": f"{url}/big", "ok": f"{url}/health"}, 4, 10))
    assert isinstance(result["pod"], Exception) and str(MAX_METRICS_BYTES) in str(result["pod"])
    assert result["ok"] == "ok"  # one pod's failure is its own
