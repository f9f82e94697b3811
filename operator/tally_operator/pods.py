"""PURE: what a pod object says of itself, as the API server lists it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in TERMINAL_PHASES


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready to serve: its Ready condition, an IP, and not being deleted."""
    status = pod.get("status") or {}
    ready = any(cond.get("type") == "Ready" and cond.get("status") == "True"
                for cond in status.get("conditions") or [])
    return bool(ready and status.get("podIP") and not (pod.get("metadata") or {}).get("deletionTimestamp"))


def is_started(pod: Mapping[str, Any]) -> bool:
    """Its containers passed their startup probes (the runtime's /health: the engine can generate), or it is
    ready; with an IP, and not being deleted. Such a pod is read and leased before it is ready: with budgets,
    its first lease is what makes it ready (tally_runtime's /ready)."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    started = bool(containers) and all(s.get("started") is True for s in containers)
    return bool((started or is_ready(pod)) and status.get("podIP")
                and not (pod.get("metadata") or {}).get("deletionTimestamp"))


def leasable_uids(pods: list[dict[str, Any]]) -> frozenset[str]:
    """The pods budgets lease to: started (ready, or held out of the Service until its first lease), not
    terminating, not ended."""
    return frozenset(p["metadata"]["uid"] for p in pods if is_started(p) and not is_terminal(p))
