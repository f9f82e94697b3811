"""PURE: one pass's new status, from the status as persisted and what the pass observed.

`plan` is what a pass writes: the workload conditions and fields it read from the children, and, when
a scrape round ran, the round booked into the persisted ledger with the health verdict over the
observations that follow it. The write is a compare-and-swap on the object's resourceVersion
(reconcile.py); when it is refused, the pass reads the status again, scrapes again and plans again, so a
stale status is never the base of a write and a stale sample is never booked.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tally_operator import constants as c
from tally_operator.budget import (
    BudgetConfig,
    LeaseReport,
    Planned,
    budgets_status,
    plan_budgets,
    state_from_status,
)
from tally_operator.conditions import Condition, Verdict, find, transitions
from tally_operator.observations import Observations, advance, following
from tally_operator.shards import (
    Shard,
    has_room,
    join_budgets,
    merged,
    split_budgets,
    split_ledger,
    totals_ledger,
)
from tally_operator.status import build_status, without_times
from tally_operator.tenant_books import book_sharded, changed_shards
from tally_operator.usage import (
    Booking,
    Ledger,
    Round,
    ledger_from_status,
    ledger_status,
    round_status,
)
from tally_operator.verdict import judge
from tally_runtime.contract import OTHER_TENANT


@dataclass(frozen=True, slots=True)
class Observed:
    """What one pass saw, independent of the status it is written against."""

    generation: int
    verdicts: Sequence[Verdict]
    fields: Mapping[str, Any]
    round: Round | None = None  # None: no scrape was due
    max_mismatch_ratio: float = 0.0
    budgets: BudgetConfig | None = None
    serving: frozenset[str] = frozenset()  # pods a lease may be sent to: started, not terminating (pods.py)
    # Keys of the persisted status this pass carries over when it does not set them (the features that are on);
    # every other key goes, since the status is written whole. None: every key (a pass that cannot tell which
    # features are on, such as one on an invalid spec)
    keep: frozenset[str] | None = None
    shards: Mapping[int, Shard] = field(default_factory=dict)  # the UsageShards as read before the scrape
    shard_key: str = ""  # the hash key for a ledger that has none yet (the status keeps it from then)


@dataclass(frozen=True, slots=True)
class Plan:
    status: dict[str, Any]
    changed: bool
    transitions: list[Condition]
    observations: Observations  # to keep once the status is written
    booking: Booking | None = None
    verdict: Verdict | None = None
    budgets: Planned | None = None  # the leases to send once the status holding them has landed
    # UsageShards to write before the status (index -> their `usage` and `budgets`), each only if it changed
    shards: Mapping[int, dict[str, Any]] = field(default_factory=dict)
    ledger: Ledger | None = None  # the whole ledger after the round (the status's totals and every shard's tenants)


def plan(previous: Mapping[str, Any], observations: Observations, observed: Observed, now: str) -> Plan:
    verdicts = list(observed.verdicts)
    fields = dict(observed.fields)
    booking, usage_verdict = None, None
    budgets: Planned | None = None
    shard_writes: dict[int, dict[str, Any]] = {}
    whole: Ledger | None = None
    if observed.round is not None:
        usage = previous.get("usage") or {}
        ledger = ledger_from_status(usage)
        persisted_key = usage.get("shardKey")
        key = persisted_key if isinstance(persisted_key, str) and persisted_key else observed.shard_key
        sharded = "shardKey" in usage
        if sharded:  # the tenants are in the shards
            shards = {index: shard.ledger for index, shard in observed.shards.items()}
        else:  # the status still holds them (the layout before shards): they move, every shard written whole
            # (one an interrupted move wrote under another key too, empty: the status is what holds the books)
            shards = {**dict.fromkeys(observed.shards, Ledger()), **split_ledger(ledger, key)}
        totals = totals_ledger(ledger)  # what the health window follows (its sequence and the pods' epochs)
        untenanted = frozenset() if sharded else \
            frozenset(uid for uid, r in ledger.readings.items() if r.tenants is None)
        booked, shard_bookings = book_sharded(totals, shards, observed.round, key, untenanted)
        after_shards = {i: b.ledger for i, b in shard_bookings.items()}
        booking = replace(booked, ledger=merged(booked.ledger, after_shards),
                          tenant_increase={t: c for b in shard_bookings.values() for t, c in b.tenant_increase.items()},
                          folded=sum(b.folded for b in shard_bookings.values()))
        whole = booking.ledger
        fresh = following(observations, totals, persisted_verdict(previous))
        observations = advance(fresh, totals, booking, observed.round)
        usage_verdict, observations = judge(observations, observed.round, observed.max_mismatch_ratio)
        verdicts.append(usage_verdict)
        fields["usage"] = {**ledger_status(totals_ledger(booked.ledger)), "shardKey": key,
                           "tenantCount": sum(1 for t in whole.tenants if t != OTHER_TENANT),
                           "tenantsFolded": whole.tenants_folded, **round_status(observed.round, now)}
        fields["usage"].pop("tenants", None)
        budget_parts: dict[int, dict[str, Any]] = {}
        if observed.budgets is not None:
            persisted = previous.get("budgets") or {}
            if "tenants" not in persisted:  # kept in the shards (else the status holds them: before the shards)
                persisted = join_budgets(persisted, [shard.budgets for shard in observed.shards.values()])
            before = merged(totals, shards)  # the whole ledger the round was booked into (budgets read tenants)
            budgets = plan_budgets(observed.budgets, before, whole, state_from_status(persisted), observed.serving,
                                   datetime.datetime.strptime(now, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC),
                                   {uid: s.wanted for uid, s in observed.round.samples.items() if s.wanted},
                                   {uid: LeaseReport(s.lease_seq, s.reach) for uid, s in observed.round.samples.items()
                                    if s.lease_seq},
                                   room=lambda tenant: has_room(after_shards, tenant, key))
            fields["budgets"], budget_parts = split_budgets(budgets_status(budgets, observed.budgets), key)
        shard_writes = changed_shards(observed.shards, after_shards, budget_parts, rewrite=not sharded)
    status = build_status(previous, verdicts, now, observed.generation, fields, observed.keep)
    return Plan(status=status, changed=without_times(status) != without_times(previous),
                transitions=transitions(previous.get("conditions") or [], status["conditions"]),
                observations=observations, booking=booking, verdict=usage_verdict, budgets=budgets,
                shards=shard_writes, ledger=whole)


def persisted_verdict(status: Mapping[str, Any]) -> Verdict | None:
    condition = find(status.get("conditions") or [], c.USAGE_HEALTHY)
    if condition is None:
        return None
    return Verdict(c.USAGE_HEALTHY, str(condition.get("status")), str(condition.get("reason")),
                   str(condition.get("message")))
