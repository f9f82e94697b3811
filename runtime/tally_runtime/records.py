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

from tally_runtime import contract
from tally_runtime.protocol import ApiError

log = logging.getLogger("tally_runtime.records")

SCHEMA = "tally.usage.v1"
NO_TENANT = "anonymous"  # requests that named no consumer


@dataclass(frozen=True, slots=True)
class UsageRecord:
    id: str  # the response id clients see (cmpl-…, chatcmpl-…), or req-… for a request refused before one
    time: float  # unix seconds when the request ended
    model: str
    endpoint: str  # completions | chat
    tenant: str
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


MAX_TENANT_LENGTH = 128


def tenant_of(header: str | None, user: str | None) -> str:
    """Who the request is for: the gateway's tenant header wins over the client's own `user` field.

    A tenant that names itself `other` would be booked together with the tenants beyond the bound (the
    shared `other` series), so it is refused; `anonymous` means what it says and shares that bucket."""
    for value, param in ((header, "tenant header"), (user, "user")):
        if value and value.strip():
            tenant = value.strip()[:MAX_TENANT_LENGTH]
            if tenant == contract.OTHER_TENANT:
                raise ApiError(400, f"The tenant name {tenant!r} is reserved for tenants beyond the server's "
                                    "bound; use another name", param=param, code="invalid_tenant")
            return tenant
    return NO_TENANT


class RecordSink:
    """Where records go: standard output (one write per record, so lines never interleave) and a file."""

    def __init__(self, stdout: bool, path: str = "") -> None:
        self.stdout = stdout
        self.file = open(Path(path), "ab", buffering=0) if path else None  # noqa: SIM115 (lives as long as the app)
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
