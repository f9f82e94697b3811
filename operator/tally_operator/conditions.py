"""PURE: condition bookkeeping in the metav1.Condition shape. lastTransitionTime moves only on a flip."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tally_operator.constants import DEGRADED, PROGRESSING, REASON_UNSCHEDULABLE

Condition = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Verdict:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def set_condition(conditions: Sequence[Condition], verdict: Verdict, now: str, generation: int) -> list[Condition]:
    """Replace (or add) one condition, keeping its lastTransitionTime unless its status flipped."""
    previous = find(conditions, verdict.type)
    moved = previous is None or previous.get("status") != verdict.status
    updated: Condition = {
        "type": verdict.type, "status": verdict.status, "reason": verdict.reason, "message": verdict.message,
        "lastTransitionTime": now if moved or previous is None else previous["lastTransitionTime"],
        "observedGeneration": generation,
    }
    return [*(c for c in conditions if c.get("type") != verdict.type), updated]


def find(conditions: Sequence[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def transitions(before: Sequence[Condition], after: Sequence[Condition]) -> list[Condition]:
    """Conditions whose status or reason changed: each one deserves an Event."""
    changed = []
    for condition in after:
        old = find(before, condition["type"])
        if old is None or (old.get("status"), old.get("reason")) != (condition["status"], condition["reason"]):
            changed.append(condition)
    return changed


SCALING_LIMITED = "ScalingLimited"  # autoscale.py's condition


def is_bad(condition: Condition) -> bool:
    """Whether a condition's news is bad (a Warning Event): Degraded, unschedulable, or any other False."""
    kind, status = condition["type"], condition["status"]
    if kind in (DEGRADED, SCALING_LIMITED):  # limited scaling is the news; within bounds is good news
        return bool(status == "True")
    if kind == PROGRESSING:
        return bool(condition["reason"] == REASON_UNSCHEDULABLE)
    return bool(status == "False")
