"""A storm of mixed requests against a real uvicorn server: nothing leaks, nothing is lost or counted twice.

2,000 requests at concurrency 48 against two generation slots and a 50 ms queue bound: streams read to the
end, streams cut after a few chunks, clients that send a request and leave while it waits, n=2, chat and
plain responses. The engine is a model-free token source behind the real runtime: the CPU-free engine
(tests/fakes/fast_engine.py), and the SGLang adapter over the contract fake's zero-cost stream (the path
on which the fan-in pump converts SGLang's items). Each request names itself in `user`, so its usage record
can be found: every request has exactly one record, every finished one bills what its client was told, an
aborted one bills at least what its client read, and the records' sums equal /metrics. Afterwards no slot
is held, nobody waits, and the server still admits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sglang
from fast_engine import FastEngine
from runtime_harness import metric_value, serving, sse_payloads, until

from tally_runtime.app import create_app
from tally_runtime.engine.base import Engine
from tally_runtime.engine.sglang import SGLangEngine
from tally_runtime.settings import Settings

REQUESTS = 2000
CONCURRENCY = 48
KINDS = ("stream", "cut", "leave", "plain", "chat", "n2")


def body(kind: str, marker: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    tokens = rng.randint(3, 12)
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": tokens,
                                        "user": marker}
    request: dict[str, Any] = {"prompt": "one two three", "max_tokens": tokens, "user": marker}
    if kind in {"stream", "cut", "leave", "n2"}:
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "n2":
        request["n"] = 2
    return "/v1/completions", request


async def raw(port: int, path: str, payload: dict[str, Any], read_chunks: int, leave_after: float) -> int:
    """Send the whole request on a socket of our own; read `read_chunks` SSE events (0: none), or wait
    `leave_after` seconds, then close. Returns the content events read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(payload)
    writer.write(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    await writer.drain()
    read = 0
    try:
        if read_chunks:
            async with asyncio.timeout(10):
                buffer = b""
                while read < read_chunks and (more := await reader.read(4096)):
                    buffer += more
                    read = buffer.count(b'"text":')
        else:
            await asyncio.sleep(leave_after)
    except TimeoutError:
        pass
    writer.close()
    return read


async def one(client: httpx.AsyncClient, port: int, kind: str, marker: str, rng: random.Random) -> dict[str, Any]:
    path, payload = body(kind, marker, rng)
    seen: dict[str, Any] = {"marker": marker, "kind": kind}
    if kind == "cut":
        seen["read"] = await raw(port, path, payload, rng.randint(1, 3), 0)
        return seen
    if kind == "leave":
        seen["read"] = await raw(port, path, payload, 0, rng.uniform(0, 0.02))
        return seen
    response = await client.post(path, json=payload)
    seen["status"] = response.status_code
    if response.status_code == 200:
        usage = sse_payloads(response.content)[-2]["usage"] if payload.get("stream") else response.json()["usage"]
        seen["usage"] = (usage["prompt_tokens"], usage["completion_tokens"])
    return seen


async def storm(url: str) -> list[dict[str, Any]]:
    rng = random.Random(25)
    port = int(url.rsplit(":", 1)[1])
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)) as http:
        async def bounded(i: int) -> dict[str, Any]:
            async with limit:
                return await one(http, port, KINDS[i % len(KINDS)], f"req-{i:05d}", rng)

        async with asyncio.timeout(240):
            return list(await asyncio.gather(*(bounded(i) for i in range(REQUESTS))))


def records_of(path: Path) -> dict[str, dict[str, Any]]:
    by_tenant: dict[str, dict[str, Any]] = {}
    for line in path.read_bytes().splitlines():
        record = orjson.loads(line)
        assert record["tenant"] not in by_tenant, f"{record['tenant']} recorded twice"
        by_tenant[record["tenant"]] = record
    return by_tenant


@pytest.fixture(params=["fast", "sglang"])
def engine_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Engine, Settings]]:
    settings = Settings(max_concurrent_generations=2, max_queue_seconds=0.05, max_queued_requests=64,
                        usage_records=False, usage_records_file=str(tmp_path / "records.jsonl"))
    if request.param == "fast":
        yield FastEngine(seconds_per_token=0.001), settings
        return
    sglang.configure(zero_cost=True, token_seconds=0.001)
    try:
        settings = dataclasses.replace(settings, engine="sglang", model_path="/models/fake")
        yield SGLangEngine(settings.engine_config()), settings
    finally:
        sglang.configure()


def test_a_storm_of_mixed_requests_leaks_nothing_and_every_request_is_recorded_once(
        engine_settings: tuple[Engine, Settings]) -> None:
    engine, settings = engine_settings
    records_file = Path(settings.usage_records_file)
    with serving(create_app(settings, engine)) as url:
        sent = asyncio.run(storm(url))

        def settled() -> bool:
            text = httpx.get(f"{url}/metrics").text
            return metric_value(text, "tally_requests_total") == REQUESTS

        assert until(settled, 30), "not every request was recorded"
        idle = httpx.get(f"{url}/metrics").text
        assert metric_value(idle, "tally_inflight_generations") == 0
        assert metric_value(idle, "tally_queued_requests") == 0
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "still there", "max_tokens": 2}, timeout=30)
        assert after.status_code == 200, after.text  # the server still admits
        metrics = httpx.get(f"{url}/metrics").text
    records = records_of(records_file)
    assert sorted(records) == sorted([*(s["marker"] for s in sent), "anonymous"])
    outcomes: dict[str, int] = {}
    for seen in sent:
        record = records[seen["marker"]]
        outcomes[record["outcome"]] = outcomes.get(record["outcome"], 0) + 1
        if "usage" in seen:
            assert record["outcome"] == "ok" and (record["prompt_tokens"], record["completion_tokens"]) == seen["usage"]
        elif seen.get("status") == 503:
            assert record["outcome"] == "overloaded" and record["completion_tokens"] == 0
        elif "read" in seen:
            assert record["completion_tokens"] >= seen["read"], (seen, record)
        else:
            raise AssertionError(f"unexpected reply {seen}")
    assert {"ok", "aborted", "overloaded"} <= set(outcomes), outcomes  # the storm did what it says
    assert sum(r["completion_tokens"] for r in records.values()) == metric_value(metrics,
                                                                                 "tally_completion_tokens_total")
    assert sum(r["prompt_tokens"] for r in records.values()) == metric_value(metrics, "tally_prompt_tokens_total")
    assert metric_value(metrics, "tally_usage_mismatches_total") == 0
    assert metric_value(metrics, "tally_derived_usage_requests_total") == 0
    served = [r for r in records.values() if r["outcome"] not in {"invalid", "overloaded"}]
    assert metric_value(metrics, "tally_tenant_requests_total") == len(served)  # refused ones are not a tenant's
