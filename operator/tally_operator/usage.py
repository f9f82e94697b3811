"""PURE: per-pod samples -> a service's usage totals, and the readings they stand on (kept in the status).

Counters are read per pod; the operator keeps each pod's last reading (by pod uid and the counters'
epoch) and adds only the increase. The readings are written to the status with the totals, in the same
write, so a restarted operator or its peer continues exactly. A pod that is unready or cannot be scraped
keeps its reading; a pod is forgotten only once the API server no longer lists it. If its last reading
was not final (the runtime drained and idle), whatever it served after that reading is missing: the pod
is counted in `podsUnaccounted`. The health verdict on these rounds is `verdict.py`'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tally_operator.conditions import Verdict
from tally_operator.samples import Counters, PodSample, stream_mode
from tally_operator.status import is_ready

WINDOW_ROUNDS = 10


@dataclass(frozen=True, slots=True)
class Reading:
    """The last counters read from one pod, and under which epoch.

    Per-tenant counters are kept in memory only (None after a restart: the next reading is their new
    baseline), so the status stays small; the totals themselves are exact across restarts."""

    counters: Counters
    epoch: float | None
    final: bool = False
    tenants: Mapping[str, Counters] | None = None


@dataclass
class UsageState:
    """What the operator remembers per service between rounds; `readings` and the totals are persisted."""

    readings: dict[str, Reading] = field(default_factory=dict)  # pod uid -> its last reading
    totals: Counters = field(default_factory=Counters)
    unaccounted: int = 0
    # Every pod counted so far has a reading. False only after an upgrade from a status without readings:
    # then pods seen first are a baseline, not new usage.
    complete: bool = True
    window: deque[Counters] = field(default_factory=lambda: deque(maxlen=WINDOW_ROUNDS))
    # pod uid -> its recent drift readings (this epoch): only a change within the window counts
    drifts: dict[str, deque[float]] = field(default_factory=dict)
    good_streak: int = 0
    unhealthy: Verdict | None = None  # the last definite verdict, when False: True needs a clean streak
    tenant_increase: dict[str, Counters] = field(default_factory=dict)  # the last round's, per tenant


@dataclass(frozen=True, slots=True)
class Round:
    samples: Mapping[str, PodSample]  # pod uid -> sample, for pods scraped successfully
    failed: frozenset[str] = frozenset()  # pod uids that could not be scraped
    present: frozenset[str] | None = None  # every pod the API server lists (None: the scraped and failed ones)


def absorb(state: UsageState, round_: Round) -> Counters:
    """Add this round's increases to the totals; returns the round's increase."""
    increase = Counters()
    state.tenant_increase = {}
    for uid, sample in round_.samples.items():
        before = state.readings.get(uid)
        tenant_base = _tenant_base(before, sample, state.complete)
        if before is None:
            base = Counters() if state.complete else sample.counters  # new pod: all of it is new usage
        elif sample.started != before.epoch:
            # The counters began again (a process restart without its journal): all of them are new,
            # even where they already climbed past the old values; what came after the last reading is lost.
            base = Counters()
            state.unaccounted += 0 if before.final else 1
            state.drifts.pop(uid, None)
        else:
            base = before.counters
        increase = increase.plus(sample.counters.increase_since(base))
        for tenant, counters in sample.tenants.items():
            more = counters.increase_since(tenant_base.get(tenant, Counters()))
            state.tenant_increase[tenant] = state.tenant_increase.get(tenant, Counters()).plus(more)
        if sample.completion_drift is not None:
            state.drifts.setdefault(uid, deque(maxlen=WINDOW_ROUNDS)).append(sample.completion_drift)
        state.readings[uid] = Reading(sample.counters, sample.started, sample.final, sample.tenants)
    present = round_.present if round_.present is not None else frozenset(round_.samples) | round_.failed
    for gone in set(state.readings) - present:
        if not state.readings.pop(gone).final:
            state.unaccounted += 1
        state.drifts.pop(gone, None)
    state.complete = True
    state.totals = state.totals.plus(increase)
    state.window.append(increase)
    return increase


def _tenant_base(before: Reading | None, sample: PodSample, complete: bool) -> Mapping[str, Counters]:
    if before is None:
        return {} if complete else sample.tenants
    if sample.started != before.epoch:
        return {}
    return sample.tenants if before.tenants is None else before.tenants


def scrape_targets(pods: Iterable[Mapping[str, Any]], readings: Mapping[str, Reading], port: int) -> dict[str, str]:
    """Pod uid -> metrics URL: every ready pod, every terminating one (its final counters), and every pod
    already counted even while it is unready (it keeps serving what it had accepted)."""
    targets = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip, uid = status.get("podIP"), meta.get("uid")
        if ip and uid and (is_ready(pod) or meta.get("deletionTimestamp") or uid in readings):
            targets[str(uid)] = f"http://{ip}:{port}/metrics"
    return targets


_STATUS_KEYS = {"requests": "requests", "prompt_tokens": "promptTokens", "completion_tokens": "completionTokens",
                "cached_tokens": "cachedTokens", "mismatches": "mismatches", "derived_requests": "derivedRequests"}


def _counters_status(counters: Counters) -> dict[str, int]:
    return {key: int(getattr(counters, name)) for name, key in _STATUS_KEYS.items()}


def _counters_from(raw: Mapping[str, object]) -> Counters:
    def num(key: str) -> float:
        value = raw.get(key, 0)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    return Counters(**{name: num(key) for name, key in _STATUS_KEYS.items()})


def usage_status(state: UsageState, round_: Round, scraped_at: str) -> dict[str, object]:
    """`status.usage`: the totals and, in the same write, every pod's reading they stand on."""
    pods = [{"uid": uid, "epoch": r.epoch, "final": r.final, **_counters_status(r.counters)}
            if r.epoch is not None else {"uid": uid, "final": r.final, **_counters_status(r.counters)}
            for uid, r in sorted(state.readings.items())]
    return {
        **_counters_status(state.totals),
        "streamMode": stream_mode(round_.samples.values()), "podsScraped": len(round_.samples),
        "podsFailed": len(round_.failed), "podsUnaccounted": state.unaccounted, "lastScrapeTime": scraped_at,
        "pods": pods,
    }


def state_from_status(usage: Mapping[str, object]) -> UsageState:
    """Resume where the last status write left off (an operator restart, or its peer taking over)."""
    readings: dict[str, Reading] = {}
    raw_pods = usage.get("pods")
    for pod in raw_pods if isinstance(raw_pods, list) else []:
        if isinstance(pod, Mapping) and isinstance(pod.get("uid"), str):
            epoch = pod.get("epoch")
            readings[str(pod["uid"])] = Reading(_counters_from(pod), float(epoch) if isinstance(
                epoch, int | float) else None, bool(pod.get("final")))
    unaccounted = usage.get("podsUnaccounted", 0)
    return UsageState(readings=readings, totals=_counters_from(usage),
                      unaccounted=unaccounted if isinstance(unaccounted, int) else 0,
                      complete=not usage or isinstance(raw_pods, list))
