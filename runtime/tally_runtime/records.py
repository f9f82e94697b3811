"""Usage records: one JSON line per request, for every outcome, to stdout and optionally to a file.

A log pipeline (Fluent Bit, Vector, Loki, ...) can bill on these lines alone: each names the request, its
tenant and the engine's own counts, and their sums equal the `/metrics` counters exactly, because both
are written at the same single point (`Server.record`). Requests that did not ask for `include_usage`,
aborted ones and refused ones are recorded all the same. The schema is versioned (`schema`); a field is
only ever added, never renamed or removed, within one version. See README "Usage records".
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

log = logging.getLogger("tally_runtime.records")

SCHEMA = "tally.usage.v1"
CLOUDEVENT_TYPE = "dev.tally.usage.v1"
FORMATS = ("tally", "cloudevents")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    id: str  # the response id clients see (cmpl-…, chatcmpl-…), or req-… for a request refused before one
    time: float  # unix seconds when the request ended
    model: str
    endpoint: str  # completions | chat | responses
    tenant: str
    tenant_source: str  # key | header | user | none: what named the tenant (auth.py)
    outcome: str  # ok | aborted | error | invalid | overloaded | over_budget | rate_limited (tally_requests_total's)
    finish_reasons: tuple[str | None, ...]  # per choice, in index order; None: the choice did not finish
    n: int  # choices generated (prompts x n)
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    derived: bool  # the engine reported no counts; streamed ids were counted instead
    time_to_first_token_seconds: float | None
    duration_seconds: float
    namespace: str = ""  # the CompletionService's namespace and name (the operator passes them): what a meter
    service: str = ""  # groups by besides the tenant (added within v1)

    def body(self) -> dict[str, object]:
        body = {"schema": SCHEMA, **{name: getattr(self, name) for name in self.__slots__}}
        body["time"] = datetime.datetime.fromtimestamp(self.time, datetime.UTC).isoformat(timespec="milliseconds")
        return body

    def to_line(self) -> bytes:
        return orjson.dumps(self.body()) + b"\n"

    def to_cloudevent(self, source: str) -> bytes:
        """The record as a CloudEvent (structured JSON, spec 1.0): what OpenMeter's ingest and its Kubernetes
        collector take. `id` is the response id, so a delivery retried downstream is deduplicated; the
        tenant is the `subject` (the customer a meter groups by); `data` is the plain record."""
        body = self.body()
        event = {"specversion": "1.0", "id": self.id, "source": source, "type": CLOUDEVENT_TYPE,
                 "subject": self.tenant, "time": body["time"], "datacontenttype": "application/json", "data": body}
        return orjson.dumps(event) + b"\n"


class LineWriter:
    """Whole lines to one file descriptor. A write may take fewer bytes than asked, and a failing volume may fail
    part-way through a line: such a torn line is ended at once if the volume lets it, or else before the next
    line goes out (the repair newline had failed on the same full volume, and the next record was merged into
    the torn one). So a torn record is one bad line, never two records in one."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.torn = False  # the output ends inside a line

    def write(self, line: bytes) -> None:
        """Write every byte of `line`, or raise OSError (the line then is at most one torn line of its own)."""
        prefix = 1 if self.torn else 0
        data = b"\n" + line if prefix else line
        done = 0
        try:
            while done < len(data):
                written = os.write(self.fd, data[done:])
                if written <= 0:
                    raise OSError("the sink took no bytes")
                done += written
            self.torn = False
        except OSError:
            if done > prefix:
                self.torn = True  # part of this line is out
            elif prefix and done == prefix:
                self.torn = False  # the earlier line was ended; nothing of this one is out
            if self.torn:
                with contextlib.suppress(OSError):
                    self.torn = os.write(self.fd, b"\n") != 1
            raise


class RecordSink:
    """Where records go: standard output and a file, as plain `tally.usage.v1` lines or as CloudEvents from
    `source`. Each record is written whole (lines never interleave or merge) or counted lost, per sink
    (`lost`, exported as tally_usage_records_lost_total{sink})."""

    def __init__(self, stdout: bool, path: str = "", cloudevents_source: str = "",
                 on_lost: Callable[[str], None] | None = None, deliver: Callable[[bytes], None] | None = None,
                 delivery_source: str = "") -> None:
        self.stdout = stdout
        self.deliver = deliver  # delivery.Delivery.append: CloudEvents to a billing system
        self.delivery_source = delivery_source or cloudevents_source or "tally-runtime"
        self.on_lost = on_lost
        self.cloudevents_source = cloudevents_source
        # 0600, as the journal: the records name every tenant and what it used
        self.fd = os.open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if path else None
        self.writers = {"stdout": LineWriter(1), "file": LineWriter(self.fd if self.fd is not None else -1)}
        self.failing = False
        self.lost: Counter[str] = Counter()

    def write(self, record: UsageRecord) -> None:
        line = record.to_cloudevent(self.cloudevents_source) if self.cloudevents_source else record.to_line()
        if self.deliver is not None:
            self.deliver(line if self.cloudevents_source else record.to_cloudevent(self.delivery_source))
        for sink, fd in (("stdout", 1 if self.stdout else None), ("file", self.fd)):
            if fd is None:
                continue
            try:
                self.writers[sink].write(line)
            except OSError as err:
                self.lost[sink] += 1
                if self.on_lost is not None:
                    self.on_lost(sink)
                if not self.failing:
                    log.error("Cannot write usage records to %s: %s (counted in tally_usage_records_lost_total)",
                              sink, err)
                self.failing = True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
