"""Usage records delivered to a billing system over HTTP, at least once, through a bounded spool on disk.

Each record (a CloudEvent, records.py) is appended to a spool file on the pod's volume in the same
event-loop turn that counts it, then sent in batches as `application/cloudevents-batch+json` (what
OpenMeter's `POST /api/v1/events` takes) by one task: a batch leaves the spool only once the receiver
answered 2xx, and the cursor of what was delivered is written in the spool's directory (replaced atomically), so a
restarted runtime sends again what it cannot vouch for. At least once: a receiver that deduplicates by event
id (the response id, stable across retries) counts each request once. A failed batch is retried with
exponential backoff (1 s doubling to 60 s). The spool (spool.py) reclaims what was delivered a segment at a time
and bounds what is not: to make room the oldest undelivered records are counted lost
(`tally_usage_records_lost_total{sink="delivery"}`), as is a line a crash tore. The drain flushes the spool
before the final hand-off, and counts lost what it could not deliver (the volume goes with the pod). The client
trusts the system's CAs or the platform's own (`--usage-records-ca-file`) and uses a proxy only when one is
given (`--usage-records-proxy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from tally_runtime.spool import Spool

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("tally_runtime.delivery")

BATCH_RECORDS = 500
MAX_BACKOFF_SECONDS = 60.0
CONTENT_TYPE = "application/cloudevents-batch+json"


class Delivery:
    def __init__(self, url: str, spool: Path, token: str = "", max_spool_bytes: int = 64 << 20,
                 timeout: float = 10.0, on_lost: Callable[[int], None] | None = None,
                 on_delivered: Callable[[int], None] | None = None, ca_file: str = "", proxy: str = "",
                 ca_pem: str = "") -> None:
        self.url = url
        self.token = token
        self.timeout = timeout
        self.ca_file, self.ca_pem, self.proxy = ca_file, ca_pem, proxy
        self.on_lost = on_lost or (lambda count: None)
        self.on_delivered = on_delivered or (lambda count: None)
        self.spool = Spool(spool, max_spool_bytes, on_lost=self.on_lost)
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # ---- the spool (event loop only)

    def append(self, line: bytes) -> None:
        """Spool one record (a CloudEvent line): in the spool or counted lost, never half."""
        if self.spool.append(line):
            self.wake.set()

    @property
    def pending(self) -> int:
        return self.spool.pending

    @property
    def empty(self) -> bool:
        return self.spool.empty

    # ---- sending

    def client(self) -> httpx.AsyncClient:
        """The receiver's client: the system's CAs, or the platform's own (`ca_file`); no proxy unless one is
        configured (the environment's proxy variables are not read: a pod's environment is its spec's)."""
        import ssl

        import httpx

        verify: ssl.SSLContext | bool = True
        if self.ca_file or self.ca_pem:
            verify = ssl.create_default_context(cafile=self.ca_file or None, cadata=self.ca_pem or None)
        return httpx.AsyncClient(timeout=self.timeout, trust_env=False, verify=verify, proxy=self.proxy or None)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        import httpx  # only a runtime that delivers needs it

        backoff = 1.0
        async with self.client() as client:
            while True:
                batch = self.spool.batch(BATCH_RECORDS)
                if batch is None:
                    self.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await self.wake.wait()
                    continue
                events = []
                for line in batch.lines:
                    try:
                        events.append(orjson.loads(line))
                    except orjson.JSONDecodeError:
                        self.on_lost(1)  # torn by a crash: not a record any more
                try:
                    if events:
                        await self._post(client, events)
                except (httpx.HTTPError, RuntimeError) as err:
                    self.spool.failed(batch)
                    log.warning("Delivering %d usage record(s) failed (%s); retrying in %.0fs", len(events), err,
                                backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
                    continue
                backoff = 1.0
                self.spool.delivered(batch)
                self.on_delivered(len(events))

    async def _post(self, client: httpx.AsyncClient, events: list[object]) -> None:
        headers = {"Content-Type": CONTENT_TYPE}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        response = await client.post(self.url, content=orjson.dumps(events), headers=headers)
        if not 200 <= response.status_code < 300:
            raise RuntimeError(f"the receiver answered {response.status_code}")

    async def flush(self, seconds: float) -> bool:
        """Until every spooled record is delivered, or `seconds` pass. True when the spool is empty."""
        try:
            async with asyncio.timeout(seconds):
                while not self.empty:
                    self.wake.set()
                    await asyncio.sleep(0.05)
        except TimeoutError:
            return False
        return True

    def abandon(self) -> int:
        """The pod goes with what is still spooled: counted lost (the volume goes with the pod)."""
        return self.spool.abandon()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.spool.close()
