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

    def to_line(self) -> bytes:
        body = {"schema": SCHEMA, **{name: getattr(self, name) for name in self.__slots__}}
        body["time"] = datetime.datetime.fromtimestamp(self.time, datetime.UTC).isoformat(timespec="milliseconds")
        return orjson.dumps(body) + b"\n"


class RecordSink:
    """Where records go: standard output (one write per record, so lines never interleave) and a file."""

    def __init__(self, stdout: bool, path: str = "") -> None:
        self.stdout = stdout
        # 0600, as the journal: the records name every tenant and what it used
        self.file = os.fdopen(os.open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab",
                              buffering=0) if path else None
        self.failing = False

    def write(self, record: UsageRecord) -> None:
        line = record.to_line()
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
