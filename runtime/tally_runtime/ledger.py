"""The counter journal: usage counters that survive a crash of the runtime process inside its pod.

After every recorded request the counters are written whole to a small JSON file (on an emptyDir the
operator mounts), by write-then-rename, so a reader finds either the old or the new version, never a torn
one. A restarted process reads it back and continues from there, under the same epoch: to the operator
the counters never reset, so a container restart loses nothing that had finished. No fsync: the file must
outlive the process, not the node (a node loss takes the pod's volume with it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tally_runtime.ledger")

VERSION = 1


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
        return json.dumps({"version": VERSION, **{name: getattr(self, name) for name in self.__slots__}}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Totals:
        data: dict[str, Any] = json.loads(raw)
        if data.pop("version", None) != VERSION:
            raise ValueError("unknown journal version")
        totals = cls(**data)
        if not isinstance(totals.requests, dict) or not isinstance(totals.tenants, dict):
            raise ValueError("requests and tenants must be objects")
        return totals


def request_key(endpoint: str, outcome: str, finish_reason: str) -> str:
    return f"{endpoint}|{outcome}|{finish_reason}"


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.temp = path.with_name(path.name + ".tmp")
        self.failing = False

    def load(self) -> Totals | None:
        """What the previous process of this pod left; None for a first start (or an unreadable file)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Totals.from_json(raw)
        except (ValueError, TypeError) as err:
            log.error("Ignoring the unreadable counter journal %s (%s): counters start again from zero", self.path,
                      err)
            return None

    def write(self, totals: Totals) -> None:
        """Replace the journal; a failure is logged once and never fails the request that caused it."""
        try:
            with open(self.temp, "wb") as out:
                out.write(totals.to_json())
            os.replace(self.temp, self.path)
        except OSError as err:
            if not self.failing:
                log.error("Cannot write the counter journal %s: %s", self.path, err)
            self.failing = True
        else:
            self.failing = False
