"""A bounded queue of lines on disk for delivery: segment files in a directory, and a cursor (segment, offset)
saying what the receiver has taken. A segment delivered to its end is deleted at once, so what the spool
holds on disk is what is undelivered plus at most one segment: a spool that keeps up never fills (the whole
file was reclaimed only when everything was delivered, and a receiver that merely kept pace saw records
counted lost with 97 % of the file delivered). The undelivered bytes are bounded: to make room, the oldest
undelivered segment is dropped and its records are counted lost (`on_lost(n)`), so the volume under the
spool is never filled (a pod over its emptyDir limit is evicted, spool and all).

Event loop only: appends are small writes to the newest segment; a batch is read from the oldest. A crash
may tear the last line of the newest segment: a runtime that starts again appends to a new segment, and the
torn line is read as one bad line (counted lost by the caller), never merged with another.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tally_runtime.records import LineWriter

SUFFIX = ".seg"
CURSOR = "cursor"


Line = tuple[tuple[int, int], bytes]  # (segment, offset) where it starts, and its bytes without the newline


@dataclass(frozen=True, slots=True)
class Batch:
    segment: int
    start: int  # the byte offset in the segment where its lines begin
    lines: list[bytes]
    used: int  # bytes the lines take, newlines included


class Spool:
    def __init__(self, directory: Path, max_bytes: int, on_lost: Callable[[int], None] = lambda n: None,
                 segment_bytes: int | None = None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        # At least eight segments to the bound, so dropping the oldest frees an eighth at most
        self.segment_bytes = segment_bytes or max(1024, min(1 << 20, max_bytes // 8))
        self.on_lost = on_lost
        _adopt_single_file(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.sizes = {n: (directory / _name(n)).stat().st_size for n in _segments(directory)}
        # when each segment's first record came (wall clock; a segment from before a restart: its file's mtime,
        # which is when its last record came, so the age shown is never more than the truth)
        self.began = {n: (directory / _name(n)).stat().st_mtime for n in self.sizes}
        self.head, self.offset = self._read_cursor()
        for n in [n for n in self.sizes if n < self.head]:  # delivered, not yet deleted when the process ended
            self._delete(n)
        if self.head not in self.sizes:
            self.offset = 0
        self.pending = sum(self._lines(n, self.offset if n == self.head else 0) for n in sorted(self.sizes))
        self.tail = max(self.sizes, default=self.head - 1) + 1  # appends always begin a segment of their own
        self.fd: int | None = None
        self.writer: LineWriter | None = None
        self.inflight: Batch | None = None

    # ---- state

    @property
    def undelivered(self) -> int:
        """Bytes not yet taken by the receiver."""
        return sum(size for n, size in self.sizes.items() if n >= self.head) - (
            self.offset if self.head in self.sizes else 0)

    @property
    def empty(self) -> bool:
        return self.undelivered <= 0

    def oldest_age(self) -> float:
        """Seconds since the oldest undelivered record was spooled, as near as the segment says (0: none)."""
        if self.empty:
            return 0.0
        head = min((n for n in self.sizes if n >= self.head), default=None)
        return max(0.0, time.time() - self.began.get(head, time.time())) if head is not None else 0.0

    # ---- appending

    def append(self, line: bytes) -> bool:
        """Queue one line (ending in a newline): True if it is on disk whole. To make room the oldest undelivered
        segments are dropped (counted lost); a line larger than the bound is itself lost."""
        if len(line) > self.max_bytes:
            self.on_lost(1)
            return False
        while self.undelivered + len(line) > self.max_bytes and self._drop_oldest():
            pass
        if self.fd is None or self.sizes.get(self.tail, 0) + len(line) > self.segment_bytes:
            self._rotate()
        assert self.fd is not None and self.writer is not None
        try:
            self.writer.write(line)
        except OSError:
            self.sizes[self.tail] = os.fstat(self.fd).st_size
            self.on_lost(1)
            return False
        self.sizes[self.tail] = os.fstat(self.fd).st_size  # the line, and a newline that ended a torn one
        self.pending += 1
        return True

    def _rotate(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.tail += 1
        self.fd = os.open(self.directory / _name(self.tail), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.writer = LineWriter(self.fd)
        self.sizes[self.tail] = 0
        self.began[self.tail] = time.time()

    def _drop_oldest(self) -> bool:
        """Drop the oldest undelivered segment (not the one being appended to, unless it is all there is), counting
        its records lost but for a batch in flight from it (counted by `failed` if that fails). False when
        nothing can be dropped."""
        if not self.sizes or self.head not in self.sizes:
            return False
        start, sending = self.offset, 0
        if self.inflight is not None and self.inflight.segment == self.head:
            start, sending = self.inflight.start + self.inflight.used, len(self.inflight.lines)
        lost = self._lines(self.head, start)
        if self.head == self.tail and self.fd is not None:
            os.close(self.fd)
            self.fd = self.writer = None
            self.tail += 1
        self._delete(self.head)
        self.head, self.offset = self.head + 1, 0
        self._write_cursor()
        self.pending = max(0, self.pending - lost - sending)  # the batch in flight leaves too, taken or lost
        if lost:
            self.on_lost(lost)
        return True

    # ---- delivering

    def batch(self, max_records: int, max_bytes: int = 4 << 20) -> Batch | None:
        """The next lines to send from the cursor (None: nothing undelivered), marked in flight."""
        while self.head in self.sizes and self.offset >= self.sizes[self.head] and self.head < self.tail:
            self._delete(self.head)  # delivered to its end, and no longer appended to
            self.head, self.offset = self.head + 1, 0
            self._write_cursor()
        if self.head not in self.sizes or self.offset >= self.sizes[self.head]:
            return None
        with (self.directory / _name(self.head)).open("rb") as f:
            f.seek(self.offset)
            chunk = f.read(min(self.sizes[self.head] - self.offset, max_bytes))
        end = chunk.rfind(b"\n") + 1
        if end == 0:  # a torn last line with nothing after it yet
            if self.head == self.tail:
                return None
            end = len(chunk)  # the torn end of a segment no longer appended to: one bad line
            lines = [chunk]
        else:
            lines = chunk[:end].split(b"\n")[:-1][:max_records]
        used = min(end, sum(len(line) + 1 for line in lines))
        self.inflight = Batch(self.head, self.offset, lines, used)
        return self.inflight

    def delivered(self, batch: Batch) -> None:
        """The receiver took the batch: the cursor moves past it (unless its segment was dropped meanwhile)."""
        self.inflight = None
        if batch.segment == self.head and batch.start == self.offset:
            self.offset += batch.used
            self._write_cursor()
            self.pending = max(0, self.pending - len(batch.lines))
            if self.offset >= self.sizes.get(self.head, 0) and self.head < self.tail:
                self._delete(self.head)
                self.head, self.offset = self.head + 1, 0
                self._write_cursor()

    def failed(self, batch: Batch) -> None:
        """The batch was not taken: it is sent again, or if its segment was dropped meanwhile it is lost."""
        self.inflight = None
        if batch.segment < self.head:
            self.on_lost(len(batch.lines))

    # ---- collected (the operator reads from the cursor and acknowledges what it forwarded)

    def position(self) -> tuple[int, int]:
        return self.head, self.offset

    def peek(self, max_records: int, max_bytes: int = 4 << 20) -> tuple[list[Line], tuple[int, int]]:
        """Up to `max_records` whole lines from the cursor across segments, each with its position, and the
        position after the last (nothing changes: reading again gives the same lines)."""
        found: list[tuple[tuple[int, int], bytes]] = []
        segment, offset, taken = self.head, self.offset, 0
        end = (segment, offset)
        for n in sorted(k for k in self.sizes if k >= self.head):
            if len(found) >= max_records or taken >= max_bytes:
                break
            start = offset if n == self.head else 0
            if start >= self.sizes[n]:
                end = (n, start)
                continue
            with (self.directory / _name(n)).open("rb") as f:
                f.seek(start)
                chunk = f.read(min(self.sizes[n] - start, max_bytes - taken))
            whole = chunk.rfind(b"\n") + 1
            if whole == 0:
                if n == self.tail:
                    break  # a line being written: the next read has it
                whole = len(chunk)  # the torn end of a segment no longer written: one bad line
            body = chunk[:whole]
            lines = body.split(b"\n")[:-1] if body.endswith(b"\n") else body.split(b"\n")
            position = start
            for line in lines:
                if len(found) >= max_records:
                    break
                found.append(((n, position), line))
                position += len(line) + 1
            end = (n, min(position, self.sizes[n]))
            taken += position - start
            if position < self.sizes[n]:
                break
        return found, end

    def acknowledge(self, segment: int, offset: int) -> int:
        """Everything before (segment, offset) was forwarded: the cursor moves there (never back, never past what
        is spooled; else ValueError). Returns the lines acknowledged."""
        if (segment, offset) < (self.head, self.offset):
            raise ValueError("that position was acknowledged already")
        if segment not in self.sizes or offset > self.sizes[segment]:
            raise ValueError("no such position in the spool")
        count = 0
        for n in sorted(k for k in self.sizes if self.head <= k <= segment):
            start = self.offset if n == self.head else 0
            stop = offset if n == segment else self.sizes[n]
            count += self._lines_between(n, start, stop)
            if n < segment:
                self._delete(n)
        self.head, self.offset = segment, offset
        if self.offset >= self.sizes.get(self.head, 0) and self.head < self.tail:
            self._delete(self.head)
            self.head, self.offset = self.head + 1, 0
        self._write_cursor()
        self.pending = max(0, self.pending - count)
        return count

    def _lines_between(self, n: int, start: int, stop: int) -> int:
        try:
            with (self.directory / _name(n)).open("rb") as f:
                f.seek(start)
                data = f.read(max(0, stop - start))
        except OSError:
            return 0
        return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)

    def abandon(self) -> int:
        """The pod goes with these records undelivered (a drain that could not deliver them): counted lost."""
        left = self.pending
        if left:
            self.on_lost(left)
        self.pending = 0
        return left

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # ---- files

    def _lines(self, n: int, start: int) -> int:
        try:
            with (self.directory / _name(n)).open("rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return 0
        return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)

    def _delete(self, n: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / _name(n)).unlink()
        self.sizes.pop(n, None)
        self.began.pop(n, None)

    def _read_cursor(self) -> tuple[int, int]:
        try:
            head, offset = (self.directory / CURSOR).read_text()[:64].split()
            cursor = int(head), int(offset)
        except (OSError, ValueError):
            return min(self.sizes, default=0), 0  # unknown: send all again (at least once)
        if cursor[0] < 0 or not 0 <= cursor[1] <= self.sizes.get(cursor[0], 0):
            return min(self.sizes, default=0), 0
        return cursor

    def _write_cursor(self) -> None:
        temporary = self.directory / (CURSOR + ".tmp")
        temporary.write_text(f"{self.head} {self.offset}")
        os.replace(temporary, self.directory / CURSOR)


def _name(n: int) -> str:
    return f"{n:012d}{SUFFIX}"


def _segments(directory: Path) -> list[int]:
    found = []
    for path in directory.iterdir():
        stem = path.name.removesuffix(SUFFIX)
        if path.name.endswith(SUFFIX) and stem.isdigit() and len(stem) == 12:
            found.append(int(stem))
    return sorted(found)


def _adopt_single_file(path: Path) -> None:
    """An earlier runtime's spool was one file at this path with its offset beside it (`<path>.offset`): it
    becomes segment 0 of a directory there, its offset the cursor, so nothing it held is lost or sent twice."""
    if not path.is_file():
        return
    offset_file = path.with_name(path.name + ".offset")
    try:
        offset = int(offset_file.read_text()[:32].strip() or 0)
    except (OSError, ValueError):
        offset = 0
    moved = path.with_name(path.name + ".adopting")
    os.replace(path, moved)
    path.mkdir()
    os.replace(moved, path / _name(0))
    (path / CURSOR).write_text(f"0 {max(0, offset)}")
    with contextlib.suppress(FileNotFoundError):
        offset_file.unlink()
