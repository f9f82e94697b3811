"""Usage records kept for the operator to collect (`--usage-records-pull`): the platform's delivery. The pod
never talks to the billing system and holds none of its credentials; the operator reads the records from the
metrics port (`GET /internal/records`), forwards them with the platform's, and acknowledges what it forwarded
(`POST /internal/records/ack`, signed like the final read), and only then does the spool reclaim them.

The records are spooled (spool.py: bounded, reclaimed as acknowledged, the oldest counted lost when full) with a
MAC under a key this process made and keeps only in memory, so a line that something else wrote into the spool
(anyone who can write to the pod's volume) is refused, not forwarded: counted in
`tally_usage_records_refused_total`. Lines from before a restart cannot be checked (the key went with the
process): they are forwarded marked unverified, and counted. Event loop only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from tally_runtime.spool import Line, Spool

MAX_READ_RECORDS = 5000
MAC_HEX = 32


def position_text(position: tuple[int, int]) -> str:
    return f"{position[0]}:{position[1]}"


def parse_position(text: object) -> tuple[int, int]:
    """`segment:offset` as the read gave it; ValueError for anything else."""
    if not isinstance(text, str) or len(text) > 40:
        raise ValueError("a position is segment:offset")
    segment, _, offset = text.partition(":")
    if not (segment.isdigit() and offset.isdigit()):
        raise ValueError("a position is segment:offset")
    return int(segment), int(offset)


class Collection:
    def __init__(self, spool: Path, max_spool_bytes: int, on_lost: Callable[[int], None] | None = None,
                 on_refused: Callable[[int], None] | None = None,
                 on_collected: Callable[[int], None] | None = None) -> None:
        self.key = secrets.token_bytes(32)  # never written anywhere
        self.on_lost = on_lost or (lambda count: None)
        self.on_refused = on_refused or (lambda count: None)
        self.on_collected = on_collected or (lambda count: None)
        self.spool = Spool(spool, max_spool_bytes, on_lost=self.on_lost)
        self.since = (self.spool.tail, 0)  # this process writes from a segment of its own: before it, an earlier's
        self.emptied = asyncio.Event()  # set when an acknowledgement leaves the spool empty (the drain waits)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()[:MAC_HEX].encode()

    def append(self, line: bytes) -> None:
        """Spool one record (a CloudEvent line, ending in a newline) with its MAC."""
        body = line.rstrip(b"\n")
        self.spool.append(self._mac(body) + b" " + body + b"\n")

    @property
    def pending(self) -> int:
        return self.spool.pending

    @property
    def empty(self) -> bool:
        return self.spool.empty

    def read(self, max_records: int) -> dict[str, Any]:
        """The records from the last acknowledged position (the same ones until acknowledged), each with whether
        this process wrote it; lines it did not write are left out (counted once, when acknowledged past)."""
        lines, through = self.spool.peek(max(1, min(max_records, MAX_READ_RECORDS)))
        return self._page(lines, through, self.spool.position(), self.spool.pending)

    async def page(self, max_records: int) -> dict[str, Any]:
        """`read`, its lines taken from the spool on the event loop (where records are appended) and parsed and
        checked in a worker thread: 5,000 records held the loop 0.1-0.2 s a call, and four readers looping
        slowed every request's /health answer from 0.07 s to 1 s."""
        lines, through = self.spool.peek(max(1, min(max_records, MAX_READ_RECORDS)))
        return await asyncio.to_thread(self._page, lines, through, self.spool.position(), self.spool.pending)

    def _page(self, lines: list[Line], through: tuple[int, int], start: tuple[int, int],
              pending: int) -> dict[str, Any]:
        records, refused, unverified = [], 0, 0
        for position, raw in lines:
            body = raw.partition(b" ")[2]
            verified = self._valid(raw)
            if not verified and position >= self.since:
                refused += 1
                continue
            try:
                event = orjson.loads(body)
            except orjson.JSONDecodeError:
                refused += 1  # torn by a crash, or not a record
                continue
            unverified += not verified
            records.append({"event": event, "verified": verified})
        return {"from": position_text(start), "through": position_text(through),
                "records": records, "refused": refused, "unverified": unverified, "pending": pending}

    def acknowledge(self, through: tuple[int, int]) -> int:
        """The operator forwarded everything before `through`: reclaimed (the lines this process did not write
        counted refused, the others collected). ValueError for a position not in the spool or acknowledged
        already."""
        lines, _ = self.spool.peek(MAX_READ_RECORDS)
        refused = sum(1 for position, raw in lines if position < through and position >= self.since
                      and not self._valid(raw))
        count = self.spool.acknowledge(*through)
        if self.spool.empty:
            self.emptied.set()
        if refused:
            self.on_refused(refused)
        self.on_collected(max(0, count - refused))
        return count

    def _valid(self, raw: bytes) -> bool:
        mac, _, body = raw.partition(b" ")
        return len(mac) == MAC_HEX and hmac.compare_digest(mac, self._mac(body))

    def start(self) -> None:
        return None

    async def flush(self, seconds: float) -> bool:
        """Until the operator has collected everything, or `seconds` pass. True when the spool is empty."""
        try:
            async with asyncio.timeout(seconds):
                while not self.empty:
                    self.emptied.clear()
                    await self.emptied.wait()
        except TimeoutError:
            return False
        return True

    def abandon(self) -> int:
        return self.spool.abandon()

    async def close(self) -> None:
        self.spool.close()
