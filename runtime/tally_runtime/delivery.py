"""Usage records delivered to a billing system over HTTP, at least once, through a bounded spool on disk.

Each record (a CloudEvent, records.py) is appended to a spool file on the pod's volume in the same
event-loop turn that counts it, then sent in batches as `application/cloudevents-batch+json` (what
OpenMeter's `POST /api/v1/events` takes) by one task: a batch leaves the spool only once the receiver
answered 2xx, and the offset of what was delivered is written next to the spool (replaced atomically), so a
restarted runtime sends again what it cannot vouch for. At least once: a receiver that deduplicates by event
id (the response id, stable across retries) counts each request once. A failed batch is retried with
exponential backoff (1 s doubling to 60 s). The spool is bounded: a record that does not fit is counted lost
(`tally_usage_records_lost_total{sink="delivery"}`), as is a line a crash tore. The drain flushes the spool
before the final hand-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from tally_runtime.records import LineWriter

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("tally_runtime.delivery")

BATCH_RECORDS = 500
MAX_BACKOFF_SECONDS = 60.0
CONTENT_TYPE = "application/cloudevents-batch+json"


class Delivery:
    def __init__(self, url: str, spool: Path, token: str = "", max_spool_bytes: int = 64 << 20,
                 timeout: float = 10.0, on_lost: Callable[[], None] | None = None,
                 on_delivered: Callable[[int], None] | None = None) -> None:
        self.url = url
        self.spool = spool
        self.offset_path = spool.with_name(spool.name + ".offset")
        self.token = token
        self.max_spool_bytes = max_spool_bytes
        self.timeout = timeout
        self.on_lost = on_lost or (lambda: None)
        self.on_delivered = on_delivered or (lambda count: None)
        self.fd = os.open(spool, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        self.writer = LineWriter(self.fd)
        self.size = os.fstat(self.fd).st_size
        # a line a crash tore: the next record starts a line of its own
        self.writer.torn = bool(self.size) and os.pread(self.fd, 1, self.size - 1) != b"\n"
        self.offset = self._read_offset()
        self.pending = self._count_pending()
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # ---- the spool (event loop only)

    def append(self, line: bytes) -> None:
        """Spool one record (a CloudEvent line): in the spool or counted lost, never half."""
        if self.size + len(line) > self.max_spool_bytes:
            self.on_lost()
            return
        try:
            self.writer.write(line)
        except OSError as err:
            log.error("Cannot spool a usage record for delivery: %s", err)
            self.on_lost()
            self.size = os.fstat(self.fd).st_size
            return
        self.size = os.fstat(self.fd).st_size  # the line, and the newline that ended a torn one before it
        self.pending += 1
        self.wake.set()

    @property
    def empty(self) -> bool:
        return self.offset >= self.size

    def _read_offset(self) -> int:
        try:
            with self.offset_path.open("rb") as f:
                offset = int(f.read(32).strip() or 0)  # a decimal offset: anything longer is not ours
        except (OSError, ValueError):
            return 0  # unknown: send it all again (at least once)
        return offset if 0 <= offset <= self.size else 0

    def _write_offset(self) -> None:
        temporary = self.offset_path.with_name(self.offset_path.name + ".tmp")
        temporary.write_text(str(self.offset))
        os.replace(temporary, self.offset_path)

    def _count_pending(self) -> int:
        return os.pread(self.fd, max(0, self.size - self.offset), self.offset).count(b"\n") if not self.empty else 0

    def _batch(self) -> tuple[list[bytes], int]:
        """Up to BATCH_RECORDS whole lines from the offset, and the bytes they take."""
        chunk = os.pread(self.fd, min(self.size - self.offset, 4 << 20), self.offset)
        end = chunk.rfind(b"\n") + 1
        lines = chunk[:end].split(b"\n")[:-1][:BATCH_RECORDS]
        used = sum(len(line) + 1 for line in lines)
        return lines, used

    # ---- sending

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        import httpx  # only a runtime that delivers needs it

        backoff = 1.0
        async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client:
            while True:
                if self.empty:
                    self._compact()
                    self.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await self.wake.wait()
                    continue
                lines, used = self._batch()
                events = []
                for line in lines:
                    try:
                        events.append(orjson.loads(line))
                    except orjson.JSONDecodeError:
                        self.on_lost()  # torn by a crash: not a record any more
                try:
                    if events:
                        await self._post(client, events)
                except (httpx.HTTPError, RuntimeError) as err:
                    log.warning("Delivering %d usage record(s) failed (%s); retrying in %.0fs", len(events), err,
                                backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
                    continue
                backoff = 1.0
                self.offset += used
                self.pending = max(0, self.pending - len(lines))
                self._write_offset()
                self.on_delivered(len(events))

    async def _post(self, client: httpx.AsyncClient, events: list[object]) -> None:
        headers = {"Content-Type": CONTENT_TYPE}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        response = await client.post(self.url, content=orjson.dumps(events), headers=headers)
        if not 200 <= response.status_code < 300:
            raise RuntimeError(f"the receiver answered {response.status_code}")

    def _compact(self) -> None:
        """Everything delivered: start the spool again (on the event loop, so no append is in between)."""
        if self.size and self.offset >= self.size:
            os.ftruncate(self.fd, 0)
            self.size = self.offset = self.pending = 0
            self._write_offset()

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

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        os.close(self.fd)
