"""PURE: the usage ledger of one CompletionService, and what one scrape round books into it.

The ledger lives in `status.usage`: the totals, the same per tenant, and each counted pod's last reading
(pod uid, the counters' epoch, the counters and its per-tenant counters) that they stand on. Every pass
starts from the ledger as persisted (never from a memory that may be older), books the round's increases and
writes the new ledger back by compare-and-swap (reconcile.py), so two writers can never regress it; a
refused write re-reads the ledger and scrapes again, so every sample booked is newer than the readings of
the ledger it is booked into.
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

Tenants follow the same rules, pod by pod, from the same readings, and their sums equal the totals field by
field (requests, prompt, completion and cached tokens): a pod's tenant series sum to its totals (samples.py
refuses a pod whose do not); a reading that went down under one epoch, in any counter or any tenant, books
nothing at all; and what a pod's tenants do not explain (only after an upgrade from a status without tenant
readings) is booked to tenant `other`. The ledger keeps at most `MAX_LEDGER_TENANTS` tenants: a tenant once
in it stays, a new one beyond the bound is booked to `other`, sticky, and `tenantsFolded` counts the names so
folded (once per pod and epoch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tally_operator.pods import is_started, is_terminal
from tally_operator.samples import MAX_COUNT, MAX_TENANTS_PER_POD, TENANT_FIELDS, Counters, PodSample, stream_mode
from tally_runtime.contract import OTHER_TENANT

MAX_LEDGER_TENANTS = 1000  # named tenants per service in the ledger; later ones are booked to `other`
MAX_NAMES = 1 << 16  # tenant names a ledger's readings refer to, as read back (its pods x 1,001 at the most)
Tenants = Mapping[str, Counters]


@dataclass(frozen=True, slots=True)
class Reading:
    """The last counters read from one pod, and under which epoch."""

    counters: Counters
    epoch: float | None
    final: bool = False
    # The pod's own tenant counters under that epoch (None: kept by a status from before tenant readings:
    # the pod's next sample is its tenants' baseline)
    tenants: Tenants | None = None
    # The pod is gone; its reading stays in the status's totals until no UsageShard holds a reading of it
    # (tenant_books.caught_up: a shard reading the totals no longer hold is otherwise a pod they never knew)
    gone: bool = False


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
    tenants: Tenants = field(default_factory=dict)  # tenant -> its totals (the four tenant fields)
    tenants_folded: int = 0  # tenant names booked to `other` because the ledger was full
    # It takes no new tenant name, for good (a UsageShard full in bytes: shards.SHARD_ROOM_BYTES): a name folded
    # into `other` never starts a line of its own later, which would hold only part of its usage
    closed: bool = False


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
    tenant_increase: Tenants = field(default_factory=dict)  # what the round added, per ledger tenant
    folded: int = 0  # tenant names newly booked to `other` because the ledger was full


def book(ledger: Ledger, round_: Round, capacity: int = MAX_LEDGER_TENANTS, down: frozenset[str] = frozenset(),
         baseline: frozenset[str] | None = None, tombstones: bool = False) -> Booking:
    """Add the round's increases to the ledger (see the module's rules). `capacity`: the named tenants the
    ledger keeps; `down`: pods whose counters went down elsewhere (another part of the books): they book nothing
    here either; `baseline`: the pods without a reading here that are a baseline (None: every such pod while
    the ledger is not complete); `tombstones`: a pod that goes keeps its reading one round more, marked gone
    (the status's totals: tenant_books.caught_up)."""
    readings = dict(ledger.readings)
    tenants = dict(ledger.tenants)
    increase, lost, regressed, folded = Counters(), 0, [], 0
    tenant_increase: dict[str, Counters] = {}
    for uid, sample in sorted(round_.samples.items()):
        before = readings.get(uid)
        if before is not None and uid not in down and _unchanged(before, sample):
            if before.final != sample.final:
                readings[uid] = Reading(before.counters, before.epoch, sample.final, before.tenants)
            continue  # nothing new on this pod (most pods of a shard, round after round)
        new = uid not in baseline if baseline is not None else ledger.complete
        base, tenant_base = _base(new, before, sample)
        if before is not None and sample.started != before.epoch:
            lost += 0 if before.final else 1
        more = sample.counters.increase_since(base)
        more_tenants = {name: c.increase_since(tenant_base.get(name, Counters())) for name, c in sample.tenants.items()}
        if uid in down or _went_down(sample, base, tenant_base, more, more_tenants):
            regressed.append(uid)  # books nothing at all: the new reading is the base from now on
            lost += 1
            more, more_tenants = Counters(), {}
        increase = increase.plus(more)
        explained = Counters()
        for name, counters in sorted(more_tenants.items()):
            explained = explained.plus(counters)
            if not counters.any():
                continue
            bucket = _bucket(name, tenants, capacity)
            if bucket != name and name not in tenant_base:
                folded += 1
            tenants[bucket] = tenants.get(bucket, Counters()).plus(counters)
            tenant_increase[bucket] = tenant_increase.get(bucket, Counters()).plus(counters)
        rest = more.tenant_part().increase_since(explained)  # only after an upgrade (see the module's rules)
        if rest.any():
            tenants[OTHER_TENANT] = tenants.get(OTHER_TENANT, Counters()).plus(rest)
            tenant_increase[OTHER_TENANT] = tenant_increase.get(OTHER_TENANT, Counters()).plus(rest)
        readings[uid] = Reading(sample.counters, sample.started, sample.final, dict(sample.tenants))
    present = round_.present if round_.present is not None else frozenset(round_.samples) | round_.failed
    for gone in sorted(set(readings) - present):
        left = readings.pop(gone)
        lost += 0 if left.final or left.gone else 1
        if tombstones and not left.gone:
            readings[gone] = replace(left, gone=True)
    # After an upgrade from a status without readings, pods are a baseline until every counted pod has one (a
    # pod whose first scrape failed is not new usage when it is read later)
    booked = Ledger(readings=readings, totals=ledger.totals.plus(increase).capped(MAX_COUNT),
                    unaccounted=ledger.unaccounted + lost,
                    sequence=ledger.sequence + 1, complete=ledger.complete or present <= set(readings),
                    tenants={name: c.capped(MAX_COUNT) for name, c in tenants.items()},
                    tenants_folded=ledger.tenants_folded + folded, closed=ledger.closed)
    return Booking(booked, increase, lost, tuple(regressed), tenant_increase, folded)


def _unchanged(before: Reading, sample: PodSample) -> bool:
    return before.epoch == sample.started and before.counters == sample.counters and \
        (before.tenants if before.tenants is not None else {}) == sample.tenants


def _base(new: bool, before: Reading | None, sample: PodSample) -> tuple[Counters, Tenants]:
    """What the sample's increase is counted from: nothing for a new pod (`new`: one without a reading is new
    usage, not a baseline) or epoch, else the last reading."""
    if before is None:
        return (Counters(), {}) if new else (sample.counters, sample.tenants)
    if sample.started != before.epoch:
        return Counters(), {}
    return before.counters, before.tenants if before.tenants is not None else sample.tenants


def _went_down(sample: PodSample, base: Counters, tenant_base: Tenants, more: Counters,
               more_tenants: Tenants) -> bool:
    """Whether any counter, of the pod or of one of its tenants, is below its base; or the tenants' increases
    exceed the pod's (a reading the ledger holds that does not add up)."""
    if sample.counters.below(base):
        return True
    if any(counters.below(tenant_base.get(name, Counters())) for name, counters in sample.tenants.items()):
        return True
    if any(name not in sample.tenants for name in tenant_base):
        return True
    explained = Counters()
    for counters in more_tenants.values():
        explained = explained.plus(counters)
    return more.tenant_part().below(explained.tenant_part())


def _bucket(name: str, tenants: Mapping[str, Counters], capacity: int) -> str:
    """The ledger tenant `name` is booked to: its own while it is in the ledger or there is room."""
    if name == OTHER_TENANT or name in tenants:
        return name
    return name if len(tenants) - (OTHER_TENANT in tenants) < capacity else OTHER_TENANT


def check_sums(ledger: Ledger) -> None:
    """The invariant: the tenants' sums equal the totals, field by field (raises AssertionError)."""
    summed = Counters()
    for counters in ledger.tenants.values():
        summed = summed.plus(counters)
    assert summed.tenant_part() == ledger.totals.tenant_part(), (summed, ledger.totals)


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
    """Pod uid -> metrics URL: every started pod (ready, or waiting for its first lease to be), every
    terminating one (its final counters), and every pod already counted even while it is unready (it keeps
    serving what it had accepted); never a terminal pod."""
    targets = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip, uid = status.get("podIP"), meta.get("uid")
        if not ip or not uid or is_terminal(pod):
            continue
        if is_started(pod) or meta.get("deletionTimestamp") or uid in readings:
            targets[str(uid)] = pod_url(str(ip), port, "/metrics")
    return targets


def pod_url(ip: str, port: int, path: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP is bracketed in a URL
    return f"http://{host}:{port}{path}"


_STATUS_KEYS = {"requests": "requests", "prompt_tokens": "promptTokens", "completion_tokens": "completionTokens",
                "cached_tokens": "cachedTokens", "mismatches": "mismatches", "derived_requests": "derivedRequests"}
_TENANT_KEYS = {name: key for name, key in _STATUS_KEYS.items() if name in TENANT_FIELDS}


def _counters_status(counters: Counters) -> dict[str, int]:
    return {key: int(getattr(counters, name)) for name, key in _STATUS_KEYS.items()}


def _count(value: object) -> float:
    """A count from the status, or 0 for anything else (the status is input too: anyone who may write it)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return float(int(value))
    return 0.0


def _counters_from(raw: Mapping[str, object]) -> Counters:
    return Counters(**{name: _count(raw.get(key, 0)) for name, key in _STATUS_KEYS.items()})


def _pod_tenants_status(tenants: Tenants, index: Mapping[str, int]) -> list[list[int]]:
    """A pod's tenant counters, compact: [name's index in the ledger's `names`, requests, prompt, completion,
    cached]. A name is written once per ledger however many pods read it: with 128-character names (up to 512
    bytes each) repeated per pod, one shard of 50 pods passed etcd's limit."""
    return [[index[name], *(int(getattr(c, f)) for f in TENANT_FIELDS)] for name, c in sorted(tenants.items())]


def _pod_tenants_from(raw: object, names: Sequence[str]) -> Tenants | None:
    """A pod's tenant readings, as `_pod_tenants_status` writes them (or, before it, a map name -> counts)."""
    tenants = {}
    if isinstance(raw, list):
        for row in raw[:MAX_TENANTS_PER_POD + 1]:
            if isinstance(row, list) and len(row) == len(TENANT_FIELDS) + 1 and isinstance(row[0], int) and \
                    not isinstance(row[0], bool) and 0 <= row[0] < len(names):
                tenants[names[row[0]]] = Counters(**{f: _count(v) for f, v in zip(TENANT_FIELDS, row[1:], strict=True)})
        return tenants
    if not isinstance(raw, Mapping):
        return None
    for name, values in sorted(raw.items())[:MAX_TENANTS_PER_POD + 1]:
        if isinstance(name, str) and isinstance(values, list) and len(values) == len(TENANT_FIELDS):
            tenants[name] = Counters(**{f: _count(v) for f, v in zip(TENANT_FIELDS, values, strict=True)})
    return tenants


def _names_from(raw: object) -> list[str]:
    """The ledger's table of tenant names its pods' readings refer to (bounded like the readings)."""
    if not isinstance(raw, list):
        return []
    return [name if isinstance(name, str) else "" for name in raw[:MAX_NAMES]]


def tenants_status(tenants: Tenants) -> dict[str, dict[str, int]]:
    return {name: {key: int(getattr(c, f)) for f, key in _TENANT_KEYS.items()} for name, c in sorted(tenants.items())}


def tenants_from(raw: object) -> dict[str, Counters]:
    """`status.usage.tenants` as data (bounded: at most the ledger's tenants and `other`)."""
    if not isinstance(raw, Mapping):
        return {}
    return {name: Counters(**{f: _count(values.get(key, 0)) for f, key in _TENANT_KEYS.items()})
            for name, values in sorted(raw.items())[:MAX_LEDGER_TENANTS + 1]
            if isinstance(name, str) and isinstance(values, Mapping)}


def ledger_status(ledger: Ledger) -> dict[str, object]:
    """The ledger's part of `status.usage`: the totals, the tenants and, in the same write, every reading they
    stand on."""
    names = sorted({name for r in ledger.readings.values() for name in (r.tenants or {})})
    index = {name: i for i, name in enumerate(names)}
    pods = [{"uid": uid, "final": r.final, **({"epoch": r.epoch} if r.epoch is not None else {}),
             **({"gone": True} if r.gone else {}),
             **_counters_status(r.counters),
             **({"tenants": _pod_tenants_status(r.tenants, index)} if r.tenants is not None else {})}
            for uid, r in sorted(ledger.readings.items())]
    return {**_counters_status(ledger.totals), "podsUnaccounted": ledger.unaccounted, "sequence": ledger.sequence,
            "tenants": tenants_status(ledger.tenants), "tenantsFolded": ledger.tenants_folded, "pods": pods,
            **({"names": names} if names else {}), **({} if ledger.complete else {"complete": False}),
            **({"closed": True} if ledger.closed else {})}


def shard_status(ledger: Ledger) -> dict[str, object]:
    """A UsageShard's `usage`: its tenants, their sums and the readings they stand on (the status counts the
    writes and the pods lost)."""
    return {k: v for k, v in ledger_status(ledger).items() if k not in ("podsUnaccounted", "sequence")}


def round_status(round_: Round, scraped_at: str) -> dict[str, object]:
    """What the last round saw (not part of the ledger)."""
    return {"streamMode": stream_mode(round_.samples.values()), "podsScraped": len(round_.samples),
            "podsFailed": len(round_.failed), "lastScrapeTime": scraped_at}


def ledger_from_status(usage: Mapping[str, object]) -> Ledger:
    """The ledger as the last status write left it (written by this operator, a predecessor or a peer). A
    status from before the tenant ledger has its totals so far in tenant `other`, so the sums hold."""
    readings: dict[str, Reading] = {}
    raw_pods = usage.get("pods")
    names = _names_from(usage.get("names"))
    for pod in raw_pods if isinstance(raw_pods, list) else []:
        if isinstance(pod, Mapping) and isinstance(pod.get("uid"), str):
            epoch = pod.get("epoch")
            readings[str(pod["uid"])] = Reading(_counters_from(pod), float(epoch) if isinstance(
                epoch, int | float) and not isinstance(epoch, bool) else None, bool(pod.get("final")),
                _pod_tenants_from(pod.get("tenants"), names), pod.get("gone") is True)
    unaccounted, sequence, folded = usage.get("podsUnaccounted", 0), usage.get("sequence", 0), \
        usage.get("tenantsFolded", 0)
    totals = _counters_from(usage)
    if "tenants" in usage:
        tenants = tenants_from(usage.get("tenants"))
    else:
        tenants = {OTHER_TENANT: totals.tenant_part()} if totals.tenant_part().any() else {}
    return Ledger(readings=readings, totals=totals,
                  unaccounted=unaccounted if isinstance(unaccounted, int) else 0,
                  sequence=sequence if isinstance(sequence, int) else 0,
                  complete=(not usage or isinstance(raw_pods, list)) and usage.get("complete") is not False,
                  tenants=tenants,
                  tenants_folded=folded if isinstance(folded, int) else 0,
                  closed=usage.get("closed") is True)
