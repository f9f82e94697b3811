"""PURE: a service's per-tenant books, split by tenant into `UsageShard` objects.

`status.usage` keeps the service's totals and each pod's last total reading (a few hundred bytes a pod);
each tenant's totals and each pod's last reading of that tenant live in one of `SHARDS` UsageShard objects,
chosen by a keyed hash of the tenant's name (the key is derived from the service's uid with the chart's signing
key, and kept in `status.usage`, so no client can aim its names at one shard). A shard is a ledger of its own
(usage.py's `Ledger`, over its tenants only): it books a round from its own readings, so booking it again after
a write that did not land books nothing twice, and each shard is written by compare-and-swap only when it
changed.

One decision per pod: a pod whose counters went down under one epoch, in the totals or in any shard, books
nothing anywhere this round (`book(..., down=...)`). The shards of a round are written before the status:
a shard write that lands and a status write that does not is booked again from the shard's own readings
(nothing twice), and the status's totals catch up from theirs.

Bounds: at most `MAX_SHARD_TENANTS` tenants a shard and `SHARD_ROOM_BYTES` as stored (a tenant whose shard is
full is booked to `other`, and refused under a budget), so 10,000 tenants a service fit with room to spare; a
shard's readings are at most its tenants times the pods, each name written once (usage.ledger_status); no
shard is written past `MAX_SHARD_BYTES` (bookkeeping.plan_books leaves the pods that would make it so for a
later round).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tally_operator.samples import Counters, PodSample
from tally_operator.usage import Ledger, Reading, Round, Tenants
from tally_runtime.contract import OTHER_TENANT

SHARDS = 64
MAX_SHARD_TENANTS = 320  # per shard: 64 x 320 = 20,480, so 10,000 tenants fit however the hash falls (p < 1e-9)
# Bounds in bytes as the API server stores a shard (its JSON in UTF-8: shard_bytes). A shard this large takes no new
# tenant (a new name goes to `other`, and is refused under a budget): 10,000 tenants of 128 CJK characters over
# 50 pods of 1,000 with a default budget fill 428 KB of it, since each name is written once per ledger
# (usage.ledger_status) and once per budgets part (compact_leases)
SHARD_ROOM_BYTES = 512 << 10
# No shard is ever written larger: what would make it so (a pod's round) is left for a later round instead
# (bookkeeping.plan). etcd refuses about 1.5 MiB; the request the client sends escapes non-ASCII, up to 3x
MAX_SHARD_BYTES = 768 << 10
SHARD_META_BYTES = 1 << 10  # what a shard's metadata and fields around its body add


@dataclass(frozen=True, slots=True)
class Shard:
    """One UsageShard as read: its ledger, its part of the budgets, and the resourceVersion a write must replace
    (None: not created)."""

    ledger: Ledger
    resource_version: str | None = None
    budgets: Mapping[str, Any] = field(default_factory=dict)  # its part of status.budgets (split_budgets)
    name: str = ""  # the object's name ("": not created yet)
    size: int = 0  # its bytes as stored (shard_bytes)


def shard_bytes(obj: Mapping[str, Any]) -> int:
    """What the API server stores for `obj`: its JSON in UTF-8 (not the 6 bytes an escape takes a character)."""
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(errors="surrogatepass"))


def shard_of(tenant: str, key: str) -> int:
    digest = hashlib.blake2b(tenant.encode(), key=key.encode()[:64], digest_size=8).digest()
    return int.from_bytes(digest, "big") % SHARDS


def shard_name(service: str, uid: str, index: int) -> str:
    """A shard's name: the service's uid in it, so a namesake's shards (a service deleted with
    --cascade=orphan, or not yet collected) never stand where this service creates its own."""
    return f"{service}-usage-{uid}-{index:02d}"


def legacy_shard_name(service: str, index: int) -> str:
    """The name shards were created under before the uid was in it (still read and written under it)."""
    return f"{service}-usage-{index:02d}"


def split_tenants(tenants: Tenants, key: str) -> dict[int, dict[str, Counters]]:
    out: dict[int, dict[str, Counters]] = {}
    for name, counters in tenants.items():
        out.setdefault(shard_of(name, key), {})[name] = counters
    return out


def _sum(tenants: Tenants) -> Counters:
    total = Counters()
    for counters in tenants.values():
        total = total.plus(counters)
    return total.tenant_part()


def split_ledger(ledger: Ledger, key: str) -> dict[int, Ledger]:
    """The shards of a ledger that kept its tenants in the status (the layout before shards): its tenants and
    each pod's tenant readings, by shard. A pod whose reading kept no tenants (older still) has none in any
    shard: its next sample is their baseline (bookkeeping.book_sharded)."""
    tenants = split_tenants(ledger.tenants, key)
    readings: dict[int, dict[str, Reading]] = {}
    for uid, reading in ledger.readings.items():
        for index, part in split_tenants(reading.tenants or {}, key).items():
            readings.setdefault(index, {})[uid] = replace(reading, counters=_sum(part), tenants=part)
    return {index: Ledger(readings=readings.get(index, {}), totals=_sum(tenants.get(index, {})),
                          tenants=tenants.get(index, {}))
            for index in sorted(set(tenants) | set(readings))}


def shard_rounds(round_: Round, key: str, shards: Mapping[int, Ledger]) -> dict[int, Round]:
    """The round as each shard books it: per pod, its tenants of that shard (their sum as its counters), for
    every shard where it has tenants now or a reading from before (a tenant that vanished under one epoch is
    a reading that went down)."""
    read_in: dict[str, set[int]] = {}
    for index, ledger in shards.items():
        for uid in ledger.readings:
            read_in.setdefault(uid, set()).add(index)
    samples: dict[int, dict[str, PodSample]] = {}
    for uid, sample in round_.samples.items():
        parts = split_tenants(sample.tenants, key)
        for index in set(parts) | read_in.get(uid, set()):
            part = parts.get(index, {})
            samples.setdefault(index, {})[uid] = PodSample(_sum(part), sample.stream_mode, started=sample.started,
                                                           final=sample.final, tenants=part, pod_uid=uid)
    present = round_.present if round_.present is not None else frozenset(round_.samples) | round_.failed
    return {index: Round(samples.get(index, {}), round_.failed, present)
            for index in sorted(set(samples) | set(shards))}


def totals_round(round_: Round) -> Round:
    """The round as the status books it: the pods' totals only."""
    return replace(round_, samples={uid: replace(s, tenants={}) for uid, s in round_.samples.items()})


def totals_ledger(ledger: Ledger) -> Ledger:
    """The status's part of a ledger: totals and each pod's total reading, no tenants."""
    return replace(ledger, tenants={}, tenants_folded=0,
                   readings={uid: replace(r, tenants=None) for uid, r in ledger.readings.items()})


def merged(totals: Ledger, shards: Mapping[int, Ledger]) -> Ledger:
    """The whole ledger in memory (budgets and /metrics read it): the status's totals and readings, every
    shard's tenants (`other` summed over the shards) and each pod's tenant readings."""
    tenants: dict[str, Counters] = {}
    pod_tenants: dict[str, dict[str, Counters]] = {}
    folded = 0
    for ledger in shards.values():
        folded += ledger.tenants_folded
        for name, counters in ledger.tenants.items():
            tenants[name] = tenants[name].plus(counters) if name in tenants else counters
        for uid, reading in ledger.readings.items():
            if reading.tenants:
                pod_tenants.setdefault(uid, {}).update(reading.tenants)
    readings = {uid: replace(r, tenants=pod_tenants.get(uid, {})) for uid, r in totals.readings.items() if not r.gone}
    return replace(totals, tenants=tenants, readings=readings, tenants_folded=folded)


def has_room(shards: Mapping[int, Ledger], tenant: str, key: str, closed: frozenset[int] = frozenset()) -> bool:
    """Whether `tenant` is in its shard, or its shard has room for it (`closed`: shards full in bytes)."""
    index = shard_of(tenant, key)
    ledger = shards.get(index)
    if ledger is not None and tenant in ledger.tenants:
        return True
    if index in closed:
        return False
    return ledger is None or named(ledger) < MAX_SHARD_TENANTS


def named(ledger: Ledger) -> int:
    """The tenants a ledger keeps by name (`other` is not one)."""
    return len(ledger.tenants) - (OTHER_TENANT in ledger.tenants)


def split_by_tenant(raw: Mapping[str, Any], maps: tuple[str, ...], listed: str, key: str
                    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """A status whose per-tenant parts go to shards: its `maps` (tenant -> value) and the `tenants` map of each
    item of its list `listed` (items named by `uid`) -> what the status keeps (the rest, the list's items without
    their tenants, and how many tenants there are and how many have nothing left) and each shard's part."""
    kept: dict[str, Any] = {k: v for k, v in raw.items() if k not in maps and k != listed}
    parts: dict[int, dict[str, Any]] = {}
    for name in maps:
        for tenant, value in (raw.get(name) or {}).items():
            parts.setdefault(shard_of(tenant, key), {}).setdefault(name, {})[tenant] = value
    items = []
    for item in raw.get(listed) or []:
        items.append({k: v for k, v in item.items() if k != "tenants"})
        for tenant, value in (item.get("tenants") or {}).items():
            part = parts.setdefault(shard_of(tenant, key), {}).setdefault(listed, {})
            part.setdefault(item["uid"], {})[tenant] = value
    tenants = raw.get("tenants") or {}
    kept.update({listed: items, "tenantCount": len(tenants),
                 "exhausted": sum(1 for view in tenants.values() if view.get("remaining") == 0)})
    return kept, {index: {name: dict(sorted(part[name].items())) for name in sorted(part)}
                  for index, part in parts.items()}


def join_by_tenant(kept: Mapping[str, Any], parts: Iterable[Mapping[str, Any]], maps: tuple[str, ...],
                   listed: str) -> dict[str, Any]:
    """The inverse of `split_by_tenant`: the status whole (its reader bounds and checks what it reads: the
    shards are input too)."""
    joined: dict[str, Any] = {k: v for k, v in kept.items() if k not in ("tenantCount", "exhausted")}
    for name in maps:
        joined[name] = {}
    inner: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name in maps:
            value = part.get(name)
            if isinstance(value, Mapping):
                joined[name].update(value)
        nested = part.get(listed)
        for uid, tenants in (nested.items() if isinstance(nested, Mapping) else []):
            if isinstance(tenants, Mapping):
                inner.setdefault(str(uid), {}).update(tenants)
    items = kept.get(listed)
    joined[listed] = [{**item, "tenants": inner.get(str(item.get("uid")), {})}
                      for item in (items if isinstance(items, list) else []) if isinstance(item, Mapping)]
    return joined


BUDGET_MAPS = ("tenants", "periodStart", "lost")  # status.budgets' maps by tenant, kept in the shards


def split_budgets(raw: Mapping[str, Any], key: str) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """`status.budgets` as budget.budgets_status writes it -> what the status keeps (the period, the count, each
    lease's pod, epoch and number) and each shard's part (its tenants' months and per pod their allowances, each
    tenant's name written once: `leaseNames`, as the readings' `names`)."""
    kept, parts = split_by_tenant(raw, BUDGET_MAPS, "leases", key)
    return kept, {index: compact_leases(part) for index, part in parts.items()}


def join_budgets(kept: Mapping[str, Any], parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return join_by_tenant(kept, [expanded_leases(part) for part in parts], BUDGET_MAPS, "leases")


def compact_leases(part: Mapping[str, Any]) -> dict[str, Any]:
    """A shard's budgets part with its pods' allowances as [name's index, allowance] rows (a name repeated per pod,
    128 characters of CJK over 50 pods, had made a shard's budgets alone larger than its bound)."""
    leases = part.get("leases")
    if not isinstance(leases, Mapping) or not leases:
        return dict(part)
    names = sorted({tenant for tenants in leases.values() for tenant in tenants})
    index = {name: i for i, name in enumerate(names)}
    return {**part, "leaseNames": names,
            "leases": {uid: [[index[t], v] for t, v in sorted(tenants.items())] for uid, tenants in leases.items()}}


def expanded_leases(part: Mapping[str, Any]) -> Mapping[str, Any]:
    """The inverse of `compact_leases` (a part written before it, with a map per pod, passes as it is). Input:
    what is malformed is left out."""
    leases, names = part.get("leases"), part.get("leaseNames")
    if not isinstance(leases, Mapping) or not isinstance(names, list):
        return part
    out: dict[str, Any] = {}
    for uid, rows in leases.items():
        if isinstance(rows, Mapping):
            out[uid] = rows
            continue
        out[uid] = {names[row[0]]: row[1] for row in (rows if isinstance(rows, list) else [])
                    if isinstance(row, list) and len(row) == 2 and isinstance(row[0], int)
                    and not isinstance(row[0], bool) and 0 <= row[0] < len(names) and isinstance(names[row[0]], str)}
    return {**{k: v for k, v in part.items() if k != "leaseNames"}, "leases": out}


SLICE_MAPS = ("tenants", "retired")  # a Budget's status maps by tenant, kept in its BudgetShards


def split_slices(raw: Mapping[str, Any], key: str) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """A Budget's status as slices.slices_status writes it -> what the Budget's status keeps (the period, the
    number of its slices, each covered service without its tenants) and each shard's part (its tenants' months
    across the services, their slices per service, and what retired services took)."""
    return split_by_tenant(raw, SLICE_MAPS, "services", key)


def join_slices(kept: Mapping[str, Any], parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return join_by_tenant(kept, parts, SLICE_MAPS, "services")


def planned_with(kept: Mapping[str, Any], read: Mapping[int, int]) -> int:
    """The number of a Budget's slices a service may say it planned with, from the Budget's status (`kept`)
    and the number each of its BudgetShards was written under (`read`, as this reader has them): the status's
    own, unless a shard is not the one the status says was written last (a cache behind, or a write whose
    status did not land): then no later than that shard's. Saying less is safe (the Budget keeps counting
    the higher slices of later changes); saying more is not."""
    seq = kept.get("seq")
    status_seq = seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0
    raw = kept.get("shardSeqs")
    written: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    behind = [shard_seq for index, shard_seq in read.items() if written.get(str(index)) != shard_seq]
    return min([status_seq, *behind])
