"""I/O: concurrent, bounded, time-limited HTTP calls to the pods. A slow, dead or hostile pod never stalls
or breaks the rest: every pod's result is its own (the body, or the exception that ended the attempt),
and a body larger than `max_bytes` is refused while it streams. Bodies are asked for and counted as sent
(`Accept-Encoding: identity`, raw bytes): a compressed body would be counted only after it was inflated,
so a small gzip body could cost hundreds of MiB; one sent compressed anyway is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import httpx

MAX_METRICS_BYTES = 4 << 20  # a runtime's /metrics is a few KB; 100 tenants make it tens of KB
IDENTITY = {"Accept-Encoding": "identity"}
T = TypeVar("T")


class BodyTooLarge(Exception):
    pass


async def scrape(urls: Mapping[str, str], concurrency: int, per_pod_seconds: float,
                 max_bytes: int = MAX_METRICS_BYTES) -> dict[str, str | Exception]:
    """GET every url (key -> url); each result is the body text or the exception that ended the attempt."""
    async def get(client: httpx.AsyncClient, url: str) -> str:
        async with client.stream("GET", url, headers=IDENTITY) as response:
            response.raise_for_status()
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in {"", "identity"}:
                raise BodyTooLarge(f"the response is encoded ({encoding[:32]}); only identity is read")
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > max_bytes:
                    raise BodyTooLarge(f"the response is larger than {max_bytes} bytes")
            return body.decode("utf-8", errors="replace")

    return await _each(urls, concurrency, per_pod_seconds, get)


Call = tuple[str, bytes, Mapping[str, str]]  # url, body, headers


async def post_all(calls: Mapping[str, Call], concurrency: int, per_pod_seconds: float) -> dict[str, int | Exception]:
    """POST a body to every url (key -> (url, body, headers)); each result is the status code or the exception."""
    async def post(client: httpx.AsyncClient, call: Call) -> int:
        response = await client.post(call[0], content=call[1], headers={"Content-Type": "application/json",
                                                                        **call[2]})
        return response.status_code

    return await _each(calls, concurrency, per_pod_seconds, post)


async def _each(items: Mapping[str, T], concurrency: int, per_pod_seconds: float,
                call: Callable[[httpx.AsyncClient, T], Awaitable[Any]]) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, item: T) -> Any:
        async with limit:
            try:
                async with asyncio.timeout(per_pod_seconds):
                    return await call(client, item)
            except Exception as err:  # whatever went wrong is this pod's alone (InvalidURL included)
                return err

    async with httpx.AsyncClient(timeout=per_pod_seconds, trust_env=False) as client:
        keys = list(items)
        results = await asyncio.gather(*(one(client, items[k]) for k in keys))
    return dict(zip(keys, results, strict=True))
