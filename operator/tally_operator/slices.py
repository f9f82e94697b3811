"""PURE: a platform Budget's tenants across the services it covers. Each covered service gets, per tenant, a
slice of the month: a value its `spent + held` (what its ledger booked this month, plus what its pods may
still spend under their leases and what its ended pods may have spent unread) must stay within. The service
leases its pods within its slice exactly as budget.py leases within a budget; this module moves slices between
services, with the same take-back rule one level up, so that per tenant

    Σ over covered services max(what it committed, the most it may be planning with) + retired <= budget.

A service reports in its status what it committed (spent + held), what its pods asked for and could not get
(`asked`), and the number of the Budget's slices it planned with (`budgetSeq`). A raise is granted only from
what is free; a lower slice counts only once the service has planned with it (its `budgetSeq` reaches the
number the change was made under): until then the higher value (`ceiling`) is counted. A service that leaves
the budget (deleted, no longer covered, or no longer applying it) keeps its ceiling counted as spent for the
month (`retired`): its pods may have spent that much under it. Slices go where requests wait: the asks first
(largest first), then headroom by recent spend (budget.shares, the pods' rule, without a per-service cap).

A month rolls over with the slices as they stand: a service's new month starts with its pods' outstanding
leases as held, which its old ceiling bounds, so the ceilings stay counted until the service reports the new
month. The Budget's `status.tenants` shows each tenant's month across the services at a glance."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tally_operator.budget import shares
from tally_operator.platform import PlatformBudget, period_now


@dataclass(frozen=True, slots=True)
class TenantReport:
    spent: int = 0
    held: int = 0  # reserved, lost included
    asked: int = 0
    lost: int = 0


@dataclass(frozen=True, slots=True)
class ServiceReport:
    """What a covered service's status says under this Budget."""

    namespace: str
    name: str
    uid: str
    applied: bool = True  # authenticated, and this is the budget it follows
    reason: str = ""  # why not
    period: str = ""  # the month its books are in ("" : it has not planned under this budget yet)
    seq: int = 0  # the Budget's slices number it planned with
    pods: int = 0
    tenants: Mapping[str, TenantReport] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Slice:
    granted: int = 0
    ceiling: int = 0  # the most the service may be planning with (a lower grant not yet seen)
    spent: int = 0  # what it had spent at the last round (the next one's recent spend is the difference)
    # The Budget's number when `granted` last changed: the ceiling falls to `granted` only once the service says
    # it planned with this number or a later one. Kept with the slice, in the same BudgetShard, so a round retried
    # after its status write was refused reads the number its shard was written with (the service's number, in
    # the status alone, was older: a retry took a lowered slice as seen and granted it again elsewhere)
    seq: int = 0


@dataclass(frozen=True, slots=True)
class ServiceSlices:
    namespace: str
    name: str
    uid: str
    seq: int = 0  # the Budget's seq when these slices last changed
    applied: bool = True
    reason: str = ""
    pods: int = 0
    tenants: Mapping[str, Slice] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SliceState:
    period: str = ""
    seq: int = 0
    services: Mapping[str, ServiceSlices] = field(default_factory=dict)  # uid -> its slices
    retired: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TenantTotals:
    budget: int
    spent: int
    held: int
    remaining: int
    unspent: int


@dataclass(frozen=True, slots=True)
class SlicesPlanned:
    state: SliceState
    tenants: Mapping[str, TenantTotals]
    changed: frozenset[str]  # services whose slices changed (their next pass should come soon)


def plan_slices(budget: PlatformBudget, state: SliceState, reports: Mapping[str, ServiceReport],
                now: datetime.datetime) -> SlicesPlanned:
    """The invariant, per tenant, after every round (test_budget_simulation.py checks it after every step):

        Σ over applying services max(committed, ceiling, granted, held while it lags a month) + retired <= budget

    where a service's `ceiling` is the most it may be planning with: a lower slice counts only once the service
    says it planned with the number of the change (`Slice.seq`), and a service still in last month's books
    counts what its pods held then, which they may spend now."""
    period = period_now(now)
    next_seq = max(state.seq + 1, int(now.timestamp() * 1000))
    retired = dict(state.retired)
    services = {uid: s for uid, s in state.services.items()}
    if state.period != period:  # a new month: ceilings stand; recent spend counts from zero
        retired = {}
        services = {uid: replace(s, tenants={t: replace(v, spent=0) for t, v in s.tenants.items()})
                    for uid, s in services.items()}
    # Services that left, or stopped applying this budget: what they may have been planning with is spent
    for uid, kept in sorted(services.items()):
        report = reports.get(uid)
        if report is not None and report.applied:
            continue
        for tenant, piece in kept.tenants.items():
            retired[tenant] = retired.get(tenant, 0) + max(piece.ceiling, piece.granted)
        if report is None:
            del services[uid]
        else:
            services[uid] = replace(kept, tenants={}, applied=False, reason=report.reason, pods=report.pods)
    for uid, report in sorted(reports.items()):
        kept = services.get(uid) or ServiceSlices(report.namespace, report.name, uid)
        services[uid] = replace(kept, namespace=report.namespace, name=report.name, applied=report.applied,
                                reason=report.reason, pods=report.pods)
    applying = sorted(uid for uid, r in reports.items() if r.applied)
    current = {uid for uid in applying if reports[uid].period == period}
    tenants = set(budget.tenants) | {t for r in reports.values() for t in r.tenants} | \
        {t for s in services.values() for t in s.tenants} | set(retired)
    new: dict[str, dict[str, Slice]] = {uid: dict(services[uid].tenants) for uid in applying}
    views: dict[str, TenantTotals] = {}
    for tenant in sorted(tenants):
        limit = budget.limit(tenant)
        if limit is None or limit.monthly_tokens is None:
            for slices in new.values():
                slices.pop(tenant, None)
            continue
        total = limit.monthly_tokens
        claims, committed, spent, lost, recent = {}, {}, {}, {}, {}
        lagging: dict[str, int] = {}  # services still in an earlier month: what their pods held then
        for uid in applying:
            piece = new[uid].get(tenant, Slice())
            books = reports[uid].tenants.get(tenant, TenantReport())
            if uid in current:
                if reports[uid].seq >= piece.seq:  # it planned with this slice
                    piece = replace(piece, ceiling=piece.granted)
                spent[uid], lost[uid] = books.spent, books.lost
                committed[uid] = books.spent + books.held
                recent[uid] = max(0, books.spent - piece.spent)
                new[uid][tenant] = piece
            elif reports[uid].period:  # its new month starts with these leases outstanding
                lagging[uid] = books.held
            claims[uid] = max(committed.get(uid, lagging.get(uid, 0)), piece.ceiling, piece.granted)
        spent_now, retired_now = sum(spent.values()), retired.get(tenant, 0)
        free = total - retired_now - sum(claims.values())
        pool = total - retired_now - spent_now - sum(claims[uid] for uid in applying if uid not in current)
        asked = {uid: reports[uid].tenants.get(tenant, TenantReport()).asked for uid in current}
        targets = shares(pool, max(0, pool), {uid: (committed[uid] - spent[uid], asked[uid], recent[uid])
                                              for uid in sorted(current)})
        wanted = {uid: spent[uid] + targets[uid] for uid in current}
        for uid in sorted(current):  # lowerings first: they free nothing until the service has seen them
            piece = new[uid][tenant]
            if wanted[uid] < piece.granted:
                new[uid][tenant] = replace(piece, granted=wanted[uid], seq=next_seq)
        for uid in sorted(current, key=lambda u: (-asked[u], u)):
            piece = new[uid][tenant]
            if wanted[uid] > piece.granted:
                raised = min(wanted[uid], claims[uid] + max(0, free))
                free -= max(0, raised - claims[uid])
                if raised > piece.granted:
                    piece = replace(piece, granted=raised, ceiling=max(piece.ceiling, raised), seq=next_seq)
            new[uid][tenant] = replace(piece, spent=spent[uid])
        for uid in sorted(current):  # a slice with no headroom, nothing asked or pending goes: the status stays small
            kept_piece = new[uid].get(tenant)
            if kept_piece is not None and not asked[uid] and kept_piece.granted <= spent[uid] \
                    and kept_piece.ceiling <= kept_piece.granted:
                del new[uid][tenant]
        claimed = sum(max(committed.get(uid, lagging.get(uid, 0)), p.ceiling, p.granted)
                      for p, uid in ((new[u].get(tenant, Slice()), u) for u in applying))
        held = max(0, claimed + retired_now - spent_now)
        views[tenant] = TenantTotals(total, spent_now, held, max(0, total - spent_now - held),
                                     max(0, total - spent_now - sum(lost.values()) - retired_now))
    seq = state.seq
    changed = frozenset(uid for uid in applying
                        if {t: p.granted for t, p in new[uid].items()} !=
                        {t: p.granted for t, p in services[uid].tenants.items()})
    if changed:
        seq = next_seq
    out = {uid: replace(s, tenants=new.get(uid, s.tenants) if s.applied else {},
                        seq=seq if uid in changed else s.seq)
           for uid, s in services.items()}
    return SlicesPlanned(SliceState(period, seq, out, {t: v for t, v in retired.items() if v}), views, changed)


def slices_status(planned: SlicesPlanned) -> dict[str, object]:
    """The Budget's status fields of this module (conditions and observedGeneration are the caller's)."""
    state = planned.state
    return {
        "period": state.period, "seq": state.seq,
        "tenants": {t: {"budget": v.budget, "spent": v.spent, "held": v.held, "remaining": v.remaining,
                        "unspent": v.unspent} for t, v in sorted(planned.tenants.items())},
        "services": [{"namespace": s.namespace, "name": s.name, "uid": uid, "seq": s.seq, "applied": s.applied,
                      **({"reason": s.reason} if s.reason else {}), "pods": s.pods,
                      "tenants": {t: {"granted": p.granted, "ceiling": p.ceiling, "spent": p.spent, "seq": p.seq}
                                  for t, p in sorted(s.tenants.items())}}
                     for uid, s in sorted(state.services.items(), key=lambda i: (i[1].namespace, i[1].name))],
        "retired": dict(sorted(state.retired.items())),
    }


def state_from_budget_status(raw: Mapping[str, object]) -> SliceState:
    """The slices as the Budget's last status write left them (anything malformed reads as absent)."""
    def whole(value: object) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    services: dict[str, ServiceSlices] = {}
    listed = raw.get("services")
    for item in listed if isinstance(listed, list) else []:
        if not isinstance(item, Mapping) or not isinstance(item.get("uid"), str):
            continue
        pieces = item.get("tenants")
        # (a slice written before it kept its number has the service's: the number of its last change)
        tenants = {str(t): Slice(whole(p.get("granted")), whole(p.get("ceiling")), whole(p.get("spent")),
                                 whole(p.get("seq")) if "seq" in p else whole(item.get("seq")))
                   for t, p in (pieces.items() if isinstance(pieces, Mapping) else []) if isinstance(p, Mapping)}
        services[item["uid"]] = ServiceSlices(str(item.get("namespace") or ""), str(item.get("name") or ""),
                                              item["uid"], whole(item.get("seq")), item.get("applied") is not False,
                                              str(item.get("reason") or ""), whole(item.get("pods")), tenants)
    retired = raw.get("retired")
    period = raw.get("period")
    return SliceState(period if isinstance(period, str) else "", whole(raw.get("seq")), services,
                      {str(t): whole(v) for t, v in retired.items()} if isinstance(retired, Mapping) else {})


def report_of(service: Mapping[str, Any], budget_name: str, applied: bool, reason: str) -> ServiceReport:
    """What a covered CompletionService's status says under this Budget: its books count only if they were
    planned under it (`status.budgets.source`), else it has not planned under it yet."""
    meta, status = service.get("metadata") or {}, service.get("status") or {}
    raw = status.get("budgets")
    books: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    pods = status.get("readyReplicas")
    report = ServiceReport(str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or ""),
                           applied, reason, pods=pods if isinstance(pods, int) and pods >= 0 else 0)
    if not applied or books.get("source") != f"Budget/{budget_name}":
        return report

    def whole(value: object) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    tenants = books.get("tenants")
    return replace(report, period=str(books.get("period") or ""), seq=whole(books.get("budgetSeq")),
                   tenants={str(t): TenantReport(whole(v.get("spent")), whole(v.get("reserved")),
                                                 whole(v.get("asked")), whole(v.get("lost")))
                            for t, v in (tenants.items() if isinstance(tenants, Mapping) else [])
                            if isinstance(v, Mapping)})
