"""The counter journal: usage counters that survive a crash of the runtime process inside its pod.

What it guarantees: a restarted process of the same pod continues the counters of every request that was
recorded before the crash, under the same epoch, so to the operator they never reset; or, when the
journal cannot vouch for that, it starts a new epoch (counters from zero), which the operator sees as a
reset and books whole. It never continues from counters that lag behind what was already exposed on
/metrics. What it cannot do: keep requests that were still in flight at the crash (they never finished),
or outlive the pod's volume (a node loss takes the emptyDir with it).

How: after every recorded request the counters are written whole, alternately into two slot files
(`<path>` and `<path>.1`), each with one `pwrite` at offset 0 on a file kept open (a rename per request
cost 0.3 ms here, benchmarks/README.md). Each slot holds a header line with a sequence number, the
payload's length and its CRC-32, then the JSON; a write torn by SIGKILL (a snapshot of many tenants spans
several pages) fails its check, and the other slot still holds the previous snapshot. Loading takes the
valid slot with the highest sequence; anything unreadable (corrupt, wrong shape, hostile values) starts a
new epoch, logged, never a crash. When a write fails (ENOSPC, EIO, EROFS, or a short write: fewer bytes
than the snapshot), the journal would lag behind the counters: both slots are removed so that a restart
begins a new epoch, and `tally_journal_healthy` says 0 until a write succeeds again (the in-memory
counters stay exact meanwhile). No fsync: the file must outlive the process, not the node.

The invariant (DESIGN.md, "The books"): a resumed epoch is never behind what was exported under it.
`resume` holds it at start-up: it continues a journal only once it has written it again, so a journal
that could not be removed (a read-only volume refuses the unlink too) and cannot be written now starts a
new epoch instead of resuming a stale slot; the start-up write also means a restart before the first
request keeps the epoch. tests/unit/runtime/test_journal_faults.py injects each fault at every write.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("tally_runtime.ledger")

VERSION = 2
MAGIC = b"tally-journal"
MAX_SNAPSHOT_BYTES = 8 << 20  # the emptyDir is 16 MiB; a bigger file is not ours
MAX_TENANTS = 100_000  # far beyond any --max-tenants: a journal with more is not ours
TENANT_FIELDS = 4  # requests, prompt, completion, cached tokens


class JournalError(ValueError):
    """A journal snapshot that cannot be trusted: the counters begin again under a new epoch."""


@dataclass(slots=True)
class Totals:
    """Every usage counter of one runtime, as plain numbers. `epoch`: when these counters began."""

    epoch: float = field(default_factory=time.time)
    requests: dict[str, float] = field(default_factory=dict)  # "endpoint|outcome|finish_reason" -> count
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    cached_tokens: float = 0.0
    mismatches: float = 0.0
    derived_requests: float = 0.0
    engine_side_prompt_tokens: float = 0.0
    # tenant -> [requests, prompt, completion, cached tokens]; and requests booked to the "other" bucket
    tenants: dict[str, list[float]] = field(default_factory=dict)
    tenant_overflow: float = 0.0

    def to_json(self) -> bytes:
        return orjson.dumps({name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_json(cls, raw: bytes) -> Totals:
        """The snapshot, checked field by field: anything but finite, non-negative counters is refused."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise JournalError(f"not JSON: {err}") from None
        if not isinstance(data, dict) or set(data) != set(cls.__slots__):
            raise JournalError("not a snapshot of the counters")
        totals = cls(epoch=_count(data["epoch"], "epoch"))
        if totals.epoch <= 0:
            raise JournalError("epoch must be positive")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "mismatches", "derived_requests",
                     "engine_side_prompt_tokens", "tenant_overflow"):
            setattr(totals, name, _count(data[name], name))
        totals.requests = _requests(data["requests"])
        totals.tenants = _tenants(data["tenants"])
        return totals


def _count(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise JournalError(f"{name} must be a finite, non-negative number")
    return float(value)


def _requests(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise JournalError("requests must be an object")
    for key in raw:
        if key.count("|") != 2:
            raise JournalError(f"request key {key[:64]!r} is not endpoint|outcome|finish_reason")
    return {key: _count(value, "a request count") for key, value in raw.items()}


def _tenants(raw: Any) -> dict[str, list[float]]:
    if not isinstance(raw, dict) or len(raw) > MAX_TENANTS:
        raise JournalError("tenants must be an object of a bounded size")
    tenants = {}
    for tenant, values in raw.items():
        if not isinstance(values, list) or len(values) != TENANT_FIELDS:
            raise JournalError(f"tenant {tenant[:64]!r} must have {TENANT_FIELDS} counters")
        tenants[tenant] = [_count(value, "a tenant counter") for value in values]
    return tenants


def request_key(endpoint: str, outcome: str, finish_reason: str) -> str:
    return f"{endpoint}|{outcome}|{finish_reason}"


def encode_slot(sequence: int, totals: Totals) -> bytes:
    payload = totals.to_json()
    header = b"%s %d %d %d %08x\n" % (MAGIC, VERSION, sequence, len(payload), zlib.crc32(payload))
    return header + payload


def decode_slot(raw: bytes) -> tuple[int, Totals]:
    """A slot's sequence and snapshot; `JournalError` for anything torn, foreign or malformed."""
    header, newline, rest = raw.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 5 or parts[0] != MAGIC:
        raise JournalError("no journal header")
    try:
        version, sequence, length, crc = int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4], 16)
    except ValueError:
        raise JournalError("malformed journal header") from None
    if version != VERSION:
        raise JournalError(f"journal version {version}, expected {VERSION}")
    payload = rest[:length]
    if length < 0 or len(payload) != length or zlib.crc32(payload) != crc or rest[length:].strip(b" "):
        raise JournalError("torn or corrupted snapshot (length or checksum)")
    return sequence, Totals.from_json(payload)


class Journal:
    def __init__(self, path: Path) -> None:
        self.paths = (path, path.with_name(path.name + ".1"))
        self.fds: list[int | None] = [None, None]
        self.sizes = [0, 0]  # bytes last written to each slot: a shorter snapshot is padded over it
        self.sequence = 0
        self.loaded = False
        self.healthy = True

    def load(self) -> Totals | None:
        """What the previous process of this pod left; None for a first start or an untrusted journal."""
        self.loaded = True
        found: list[tuple[int, Totals]] = []
        problems: list[str] = []
        for path in self.paths:
            try:
                with path.open("rb") as file:
                    raw = file.read(MAX_SNAPSHOT_BYTES + 1)
            except FileNotFoundError:
                continue
            except OSError as err:
                problems.append(f"{path.name}: {err}")
                continue
            try:
                if len(raw) > MAX_SNAPSHOT_BYTES:
                    raise JournalError(f"larger than {MAX_SNAPSHOT_BYTES} bytes")
                found.append(decode_slot(raw))
            except JournalError as err:
                problems.append(f"{path.name}: {err}")
        if not found:
            if problems:
                log.error("Ignoring the unreadable counter journal (%s): counters start again under a new epoch",
                          "; ".join(problems))
            return None
        self.sequence, totals = max(found, key=lambda item: item[0])
        if problems:
            log.warning("Counter journal: one slot was unusable (%s); continuing from the other", "; ".join(problems))
        return totals

    def write(self, totals: Totals) -> None:
        """Write the next slot; a failure is logged and invalidates the journal, never the request."""
        if not self.loaded:  # the next sequence follows whatever a previous process left
            self.load()
        self.sequence += 1
        slot = (self.sequence + 1) % 2  # 1, 3, 5, ... to `<path>`; 2, 4, ... to `<path>.1`
        try:
            fd = self.fds[slot]
            if fd is None:
                fd = self.fds[slot] = os.open(self.paths[slot], os.O_WRONLY | os.O_CREAT, 0o600)
                self.sizes[slot] = os.fstat(fd).st_size
            data = encode_slot(self.sequence, totals).ljust(self.sizes[slot])
            written = os.pwrite(fd, data, 0)
            self.sizes[slot] = max(self.sizes[slot], written)
            if written != len(data):  # a filling volume: the slot is torn, the journal behind the counters
                raise OSError(f"short write ({written} of {len(data)} bytes)")
        except OSError as err:
            if self.healthy:
                log.error("Cannot write the counter journal %s: %s; it is removed, so a restart starts a new "
                          "epoch instead of continuing from counters that lag", self.paths[slot], err)
            self.healthy = False
            self._discard()
        else:
            if not self.healthy:
                log.info("The counter journal %s is written again", self.paths[slot])
            self.healthy = True

    def resume(self) -> Totals:
        """The counters to start this process with: the journal's, continued only if the journal can be
        written now; otherwise (or with no trusted journal) a new epoch."""
        resumed = self.load()
        totals = resumed or Totals()
        self.write(totals)
        if resumed is not None and not self.healthy:
            log.error("The counter journal was read but cannot be written: the counters start again under a new "
                      "epoch rather than continue from a snapshot that may lag behind what was exported")
            totals = Totals()
            self.write(totals)
        return totals

    def _discard(self) -> None:
        """Remove both slots (unlinking works on a full disk): a restart then finds no journal."""
        self.close()
        for path in self.paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                log.error("Cannot remove the counter journal %s: %s", path, err)
        self.sizes = [0, 0]

    def close(self) -> None:
        for slot, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[slot] = None
