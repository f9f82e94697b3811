"""Usage records: one JSON line per request, for every outcome, to stdout and optionally to a file.

A log pipeline (Fluent Bit, Vector, Loki, ...) can bill on these lines alone: each names the request, its
tenant and the engine's own counts, and their sums equal the `/metrics` counters exactly, because both
are written at the same single point (`Server.record`). Requests that did not ask for `include_usage`,
aborted ones and refused ones are recorded all the same. The schema is versioned (`schema`); a field is
only ever added, never renamed or removed, within one version. See README "Usage records".
"""

from __future__ import annotations

import datetime
import logging
import os
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
    endpoint: str  # completions | chat
    tenant: str
    tenant_source: str  # key | header | user | none: what named the tenant (auth.py)
    outcome: str  # ok | aborted | error | invalid | overloaded (as tally_requests_total's label)
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


class RecordSink:
    """Where records go: standard output (one write per record, so lines never interleave) and a file, as
    plain `tally.usage.v1` lines or as CloudEvents from `source`."""

    def __init__(self, stdout: bool, path: str = "", cloudevents_source: str = "") -> None:
        self.stdout = stdout
        self.cloudevents_source = cloudevents_source
        # 0600, as the journal: the records name every tenant and what it used
        self.file = os.fdopen(os.open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab",
                              buffering=0) if path else None
        self.failing = False

    def write(self, record: UsageRecord) -> None:
        line = record.to_cloudevent(self.cloudevents_source) if self.cloudevents_source else record.to_line()
        try:
            if self.stdout:
                os.write(1, line)
            if self.file is not None:
                self.file.write(line)
        except OSError as err:
            if not self.failing:
                log.error("Cannot write usage records: %s", err)
            self.failing = True

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
