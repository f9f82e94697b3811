"""PURE: what a pod object says of itself, as the API server lists it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready to serve: its Ready condition, an IP, and not being deleted."""
    status = pod.get("status") or {}
    ready = any(cond.get("type") == "Ready" and cond.get("status") == "True"
                for cond in status.get("conditions") or [])
    return bool(ready and status.get("podIP") and not (pod.get("metadata") or {}).get("deletionTimestamp"))
