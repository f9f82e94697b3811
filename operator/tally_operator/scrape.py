"""I/O: concurrent, bounded, time-limited GETs of pod /metrics. A slow or dead pod never stalls the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx


async def scrape(urls: Mapping[str, str], concurrency: int, per_pod_seconds: float) -> dict[str, str | Exception]:
    """GET every url (key -> url); each result is the body text or the exception that ended the attempt."""
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, url: str) -> str | Exception:
        async with limit:
            try:
                async with asyncio.timeout(per_pod_seconds):
                    response = await client.get(url)
                    response.raise_for_status()
                    return response.text
            except (httpx.HTTPError, TimeoutError, OSError) as err:
                return err

    async with httpx.AsyncClient(timeout=per_pod_seconds, trust_env=False) as client:
        keys = list(urls)
        results = await asyncio.gather(*(one(client, urls[k]) for k in keys))
    return dict(zip(keys, results, strict=True))
