"""PURE: the usage ledger of one CompletionService, and what one scrape round books into it.

The ledger lives in `status.usage`: the totals, and each counted pod's last reading (pod uid, the counters'
epoch, the counters) that the totals stand on. Every pass starts from the ledger as persisted (never from
a memory that may be older), books the round's increases and writes the new ledger back by
compare-and-swap (reconcile.py), so two writers can never regress it; a refused write re-reads the ledger
and scrapes again, so every sample booked is newer than the readings of the ledger it is booked into.
`book` is pure: the same ledger and round give the same result.

The rules, per pod and per counter:
- a pod without a reading is new: all of its counters are new usage (after an upgrade from a status that
  kept no readings, its first reading is a baseline instead);
- the same epoch: the increase since the reading; a counter that went down under one epoch (a runtime
  that came back from a journal lagging behind what was read) books nothing and becomes the new reading,
  so nothing is ever counted twice; the pod is counted unaccounted;
- a new epoch: the counters began again from zero, all of them are new; what came after the previous
  reading is lost unless that reading was final (the pod had drained);
- a pod that is no longer listed, or that reached a terminal phase, leaves the ledger; if its last reading
  was not final, what it served after it is lost: `podsUnaccounted`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tally_operator.samples import MAX_COUNT, Counters, PodSample, stream_mode
from tally_operator.status import is_ready

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class Reading:
    """The last counters read from one pod, and under which epoch."""

    counters: Counters
    epoch: float | None
    final: bool = False


@dataclass(frozen=True, slots=True)
class Ledger:
    """`status.usage` as data. `sequence` counts the ledger's writes: a memory that followed another
    sequence was written by another operator in the meantime."""

    readings: Mapping[str, Reading] = field(default_factory=dict)  # pod uid -> its last reading
    totals: Counters = field(default_factory=Counters)
    unaccounted: int = 0
    sequence: int = 0
    # Every pod counted so far has a reading. False only after an upgrade from a status without readings:
    # then pods seen first are a baseline, not new usage.
    complete: bool = True


@dataclass(frozen=True, slots=True)
class Round:
    samples: Mapping[str, PodSample]  # pod uid -> sample, for pods scraped successfully
    failed: frozenset[str] = frozenset()  # pod uids that could not be scraped
    present: frozenset[str] | None = None  # pods still counted: listed and not terminal (None: scraped + failed)


@dataclass(frozen=True, slots=True)
class Booking:
    ledger: Ledger  # the ledger after the round
    increase: Counters  # what the round added to the totals
    lost: int = 0  # pods newly counted unaccounted
    regressed: tuple[str, ...] = ()  # pods whose counters went down under one epoch


def book(ledger: Ledger, round_: Round) -> Booking:
    """Add the round's increases to the ledger (see the module's rules)."""
    readings = dict(ledger.readings)
    increase, lost, regressed = Counters(), 0, []
    for uid, sample in sorted(round_.samples.items()):
        before = readings.get(uid)
        if before is None:
            base = Counters() if ledger.complete else sample.counters
        elif sample.started != before.epoch:
            base = Counters()
            lost += 0 if before.final else 1
        else:
            base = before.counters
            if sample.counters.below(base):
                regressed.append(uid)
                lost += 1
        increase = increase.plus(sample.counters.increase_since(base))
        readings[uid] = Reading(sample.counters, sample.started, sample.final)
    present = round_.present if round_.present is not None else frozenset(round_.samples) | round_.failed
    for gone in sorted(set(readings) - present):
        lost += 0 if readings.pop(gone).final else 1
    # After an upgrade from a status without readings, pods are a baseline until every counted pod has one (a
    # pod whose first scrape failed is not new usage when it is read later)
    booked = Ledger(readings=readings, totals=ledger.totals.plus(increase).capped(MAX_COUNT),
                    unaccounted=ledger.unaccounted + lost,
                    sequence=ledger.sequence + 1, complete=ledger.complete or present <= set(readings))
    return Booking(booked, increase, lost, tuple(regressed))


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in TERMINAL_PHASES


def owned_pods(pods: Iterable[Mapping[str, Any]], replica_sets: Iterable[Mapping[str, Any]],
               deployment: Mapping[str, Any] | None, owner_uid: str) -> list[Mapping[str, Any]]:
    """The pods this CompletionService owns: controlled by a ReplicaSet that its own Deployment controls.
    A pod that merely carries the label (another team's, or one of a deleted namesake) is not counted."""
    if deployment is None or controller_uid(deployment) != owner_uid:
        return []
    deployment_uid = (deployment.get("metadata") or {}).get("uid")
    ours = {(rs.get("metadata") or {}).get("uid") for rs in replica_sets if controller_uid(rs) == deployment_uid}
    return [pod for pod in pods if controller_uid(pod) in ours]


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (its ownerReference with controller: true), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def counted_uids(pods: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Pods that still count: listed and not terminal (a Failed pod keeps its IP, which the CNI reuses)."""
    return frozenset(str(p["metadata"]["uid"]) for p in pods if not is_terminal(p))


def scrape_targets(pods: Iterable[Mapping[str, Any]], readings: Mapping[str, Reading], port: int) -> dict[str, str]:
    """Pod uid -> metrics URL: every ready pod, every terminating one (its final counters), and every pod
    already counted even while it is unready (it keeps serving what it had accepted); never a terminal pod."""
    targets = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip, uid = status.get("podIP"), meta.get("uid")
        if not ip or not uid or is_terminal(pod):
            continue
        if is_ready(pod) or meta.get("deletionTimestamp") or uid in readings:
            targets[str(uid)] = pod_url(str(ip), port, "/metrics")
    return targets


def pod_url(ip: str, port: int, path: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP is bracketed in a URL
    return f"http://{host}:{port}{path}"


_STATUS_KEYS = {"requests": "requests", "prompt_tokens": "promptTokens", "completion_tokens": "completionTokens",
                "cached_tokens": "cachedTokens", "mismatches": "mismatches", "derived_requests": "derivedRequests"}


def _counters_status(counters: Counters) -> dict[str, int]:
    return {key: int(getattr(counters, name)) for name, key in _STATUS_KEYS.items()}


def _counters_from(raw: Mapping[str, object]) -> Counters:
    def num(key: str) -> float:
        value = raw.get(key, 0)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else 0.0

    return Counters(**{name: num(key) for name, key in _STATUS_KEYS.items()})


def ledger_status(ledger: Ledger) -> dict[str, object]:
    """The ledger's part of `status.usage`: the totals and, in the same write, every reading they stand on."""
    pods = [{"uid": uid, "final": r.final, **({"epoch": r.epoch} if r.epoch is not None else {}),
             **_counters_status(r.counters)} for uid, r in sorted(ledger.readings.items())]
    return {**_counters_status(ledger.totals), "podsUnaccounted": ledger.unaccounted, "sequence": ledger.sequence,
            "pods": pods}


def round_status(round_: Round, scraped_at: str) -> dict[str, object]:
    """What the last round saw (not part of the ledger)."""
    return {"streamMode": stream_mode(round_.samples.values()), "podsScraped": len(round_.samples),
            "podsFailed": len(round_.failed), "lastScrapeTime": scraped_at}


def ledger_from_status(usage: Mapping[str, object]) -> Ledger:
    """The ledger as the last status write left it (written by this operator, a predecessor or a peer)."""
    readings: dict[str, Reading] = {}
    raw_pods = usage.get("pods")
    for pod in raw_pods if isinstance(raw_pods, list) else []:
        if isinstance(pod, Mapping) and isinstance(pod.get("uid"), str):
            epoch = pod.get("epoch")
            readings[str(pod["uid"])] = Reading(_counters_from(pod), float(epoch) if isinstance(
                epoch, int | float) and not isinstance(epoch, bool) else None, bool(pod.get("final")))
    unaccounted, sequence = usage.get("podsUnaccounted", 0), usage.get("sequence", 0)
    return Ledger(readings=readings, totals=_counters_from(usage),
                  unaccounted=unaccounted if isinstance(unaccounted, int) else 0,
                  sequence=sequence if isinstance(sequence, int) else 0,
                  complete=not usage or isinstance(raw_pods, list))
