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
    MAX_SHARD_BYTES,
    SHARD_META_BYTES,
    SHARD_ROOM_BYTES,
    Shard,
    has_room,
    join_budgets,
    merged,
    named,
    shard_bytes,
    shard_of,
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
    blocked: frozenset[int] = frozenset()  # shards whose name holds an object not this service's (not writable)


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
    left_out: Mapping[str, str] = field(default_factory=dict)  # pods whose round waits for a later one, and why


def plan(previous: Mapping[str, Any], observations: Observations, observed: Observed, now: str) -> Plan:
    verdicts = list(observed.verdicts)
    fields = dict(observed.fields)
    books: Books | None = None
    usage_verdict = None
    if observed.round is not None:
        books = plan_books(previous, observed, now)
        fresh = following(observations, books.totals_before, persisted_verdict(previous))
        observations = advance(fresh, books.totals_before, books.booking, books.round)
        usage_verdict, observations = judge(observations, books.round, observed.max_mismatch_ratio)
        verdicts.append(usage_verdict)
        fields.update(books.fields)
    status = build_status(previous, verdicts, now, observed.generation, fields, observed.keep)
    changed = status_changed(status, previous, now)
    if not changed and books is not None:  # an idle round: the persisted ledger (its sequence) is still the one
        persisted = ledger_from_status(previous.get("usage") or {})
        observations = replace(observations, sequence=persisted.sequence)
    return Plan(status=status, changed=changed,
                transitions=transitions(previous.get("conditions") or [], status["conditions"]),
                observations=observations, booking=books.booking if books else None, verdict=usage_verdict,
                budgets=books.budgets if books else None, shards=books.shard_writes if books else {},
                ledger=books.booking.ledger if books else None, left_out=books.left_out if books else {})


REFRESH_SECONDS = 60  # an idle service's status says it is read at least this often (usage.lastScrapeTime)


def status_changed(status: Mapping[str, Any], previous: Mapping[str, Any], now: str) -> bool:
    """Whether `status` must be written over `previous`: it says something new. A round that booked nothing
    (the ledger's sequence and the scrape time alone moved) writes only once the scrape time is
    `REFRESH_SECONDS` old: an idle service's status was rewritten every round."""
    if without_times(status) == without_times(previous):
        return False
    if without_round(status) != without_round(previous):
        return True
    last = (previous.get("usage") or {}).get("lastScrapeTime")
    try:
        age = (parse_time(now) - parse_time(str(last))).total_seconds()
    except ValueError:
        return True
    return not 0 <= age < REFRESH_SECONDS


def without_round(status: Mapping[str, Any]) -> dict[str, Any]:
    usage = {k: v for k, v in (status.get("usage") or {}).items() if k not in ("sequence", "lastScrapeTime")}
    return {**without_times(status), "usage": usage}


def parse_time(stamp: str) -> datetime.datetime:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


@dataclass(frozen=True, slots=True)
class Books:
    """One round booked into the status's totals and the shards, and the budgets planned on it."""

    round: Round  # the round as booked (pods left out of it count as not read)
    booking: Booking  # its ledger: the whole one (the status's totals and every shard's tenants)
    totals_before: Ledger  # the status's part of the ledger it was booked into
    fields: dict[str, Any]  # status.usage (and status.budgets)
    shard_writes: dict[int, dict[str, Any]]
    budgets: Planned | None
    left_out: dict[str, str]  # pod uid -> why its round waits for a later one
    shard_ledgers: dict[int, Ledger]  # each shard's ledger after the round


def plan_books(previous: Mapping[str, Any], observed: Observed, now: str) -> Books:
    """The round booked, bounded in bytes: a shard past `SHARD_ROOM_BYTES` takes no more new tenants than fit
    under it (the rest go to `other`, and it takes none from then on), and a pod whose round would make a shard
    larger than `MAX_SHARD_BYTES` (or touches one whose name is taken) is left out of this round (counted as not
    read: its next reading books it), so no bound ever stops a pass before its status lands."""
    assert observed.round is not None
    limits = {i: named(shard.ledger) for i, shard in observed.shards.items()
              if shard.size >= SHARD_ROOM_BYTES or shard.ledger.closed}
    left_out: dict[str, str] = {}
    carry = False
    while True:
        round_ = without(observed.round, left_out)
        books = book_round(previous, observed, round_, now, limits, left_out, carry)
        sizes = {i: shard_bytes(body) + SHARD_META_BYTES for i, body in books.shard_writes.items()}
        fewer = fewer_names(observed.shards, books.shard_ledgers, sizes, limits)
        if fewer:  # it took new tenants past the bound: as many as fit stay, the rest go to `other`
            limits.update(fewer)
            continue
        over = {i for i, size in sizes.items() if size > MAX_SHARD_BYTES} | (set(sizes) & observed.blocked)
        touching = pods_in(over, round_, observed, previous)
        if not over:
            return books
        if not touching:  # what is left to write there is the budgets' part: planned again next round, kept now
            if carry:
                return replace(books, shard_writes={i: b for i, b in books.shard_writes.items() if i not in over})
            carry = True
            continue
        for uid in touching:
            index = min(over & shards_of(uid, round_, observed, previous))
            left_out[uid] = f"its round would make UsageShard {index} too large, or that shard's name is taken"


def fewer_names(read: Mapping[int, Shard], booked: Mapping[int, Ledger], sizes: Mapping[int, int],
                limits: Mapping[int, int]) -> dict[int, int]:
    """The named tenants each shard that grew past `SHARD_ROOM_BYTES` with new names may keep: as many of its new
    names as fit in what was left under the bound, by the bytes each took this round (at least one fewer than
    it took, so the plan converges)."""
    out: dict[int, int] = {}
    for index, size in sizes.items():
        ledger = booked.get(index)
        if size <= SHARD_ROOM_BYTES or ledger is None:
            continue
        shard = read.get(index)
        before = named(shard.ledger) if shard is not None else 0
        after = named(ledger)
        if after <= before:
            continue  # no new name to leave out: only the hard bound is left (pods wait)
        base = shard.size if shard is not None else SHARD_META_BYTES
        fit = before + (after - before) * max(0, SHARD_ROOM_BYTES - base) // max(1, size - base)
        out[index] = max(before, min(fit, after - 1, limits.get(index, after)))
    return out


def book_round(previous: Mapping[str, Any], observed: Observed, round_: Round, now: str, limits: Mapping[int, int],
               left_out: Mapping[str, str], carry: bool = False) -> Books:
    """`limits`: the named tenants a shard may hold after the round (full in bytes); `carry`: the budgets as
    persisted, unchanged (no lease moves) even where they apply."""
    closed = frozenset(limits)
    usage = previous.get("usage") or {}
    ledger = ledger_from_status(usage)
    key, sharded = shard_key(usage, observed), "shardKey" in usage
    if sharded:  # the tenants are in the shards
        shards = {index: shard.ledger for index, shard in observed.shards.items()}
    else:  # the status still holds them (the layout before shards): they move, every shard written whole
        # (one an interrupted move wrote under another key too, empty: the status is what holds the books)
        shards = {**dict.fromkeys(observed.shards, Ledger()), **split_ledger(ledger, key)}
    totals = totals_ledger(ledger)  # what the health window follows (its sequence and the pods' epochs)
    untenanted = frozenset() if sharded else \
        frozenset(uid for uid, r in ledger.readings.items() if r.tenants is None)
    booked, shard_bookings = book_sharded(totals, shards, round_, key, untenanted, limits)
    after_shards = {i: b.ledger for i, b in shard_bookings.items()}
    booking = replace(booked, ledger=merged(booked.ledger, after_shards),
                      tenant_increase={t: c for b in shard_bookings.values() for t, c in b.tenant_increase.items()},
                      folded=sum(b.folded for b in shard_bookings.values()))
    whole = booking.ledger
    fields: dict[str, Any] = {"usage": {**ledger_status(totals_ledger(booked.ledger)), "shardKey": key,
                                        "tenantCount": sum(1 for t in whole.tenants if t != OTHER_TENANT),
                                        "tenantsFolded": whole.tenants_folded, **round_status(round_, now)}}
    fields["usage"].pop("tenants", None)
    budget_parts: dict[int, dict[str, Any]] = {}
    budgets: Planned | None = None
    if observed.budgets is not None and not carry:
        persisted = previous.get("budgets") or {}
        if "tenants" not in persisted:  # kept in the shards (else the status holds them: before the shards)
            persisted = join_budgets(persisted, [shard.budgets for shard in observed.shards.values()])
        before = merged(totals, shards)  # the whole ledger the round was booked into (budgets read tenants)
        budgets = plan_budgets(observed.budgets, before, whole, state_from_status(persisted),
                               observed.serving - set(left_out),
                               parse_time(now),
                               {uid: s.wanted for uid, s in round_.samples.items() if s.wanted},
                               {uid: LeaseReport(s.lease_seq, s.reach) for uid, s in round_.samples.items()
                                if s.lease_seq},
                               room=lambda tenant: has_room(after_shards, tenant, key, closed))
        fields["budgets"], budget_parts = split_budgets(budgets_status(budgets, observed.budgets), key)
    elif "budgets" in previous and (carry or observed.keep is None or "budgets" in observed.keep):
        # A pass that cannot tell whether budgets apply (a spec refused) carries them as they are: rewriting the
        # shards without them would erase every tenant's month
        budget_parts = {i: dict(shard.budgets) for i, shard in observed.shards.items() if shard.budgets}
    shard_writes = changed_shards(observed.shards, after_shards, budget_parts, rewrite=not sharded)
    return Books(round_, booking, totals, fields, shard_writes, budgets, dict(left_out), after_shards)


def shard_key(usage: Mapping[str, Any], observed: Observed) -> str:
    persisted = usage.get("shardKey")
    return persisted if isinstance(persisted, str) and persisted else observed.shard_key


def without(round_: Round, left_out: Mapping[str, str]) -> Round:
    """The round with the pods `left_out` counted as not read (their readings stand; their next one books them)."""
    if not left_out:
        return round_
    return replace(round_, samples={uid: s for uid, s in round_.samples.items() if uid not in left_out},
                   failed=round_.failed | (frozenset(left_out) & frozenset(round_.samples)))


def shards_of(uid: str, round_: Round, observed: Observed, previous: Mapping[str, Any]) -> set[int]:
    """The shards pod `uid`'s round books into: those of its tenants now, and those holding a reading of it."""
    key = shard_key(previous.get("usage") or {}, observed)
    sample = round_.samples.get(uid)
    now = {shard_of(name, key) for name in (sample.tenants if sample is not None else {})}
    return now | {i for i, shard in observed.shards.items() if uid in shard.ledger.readings}


def pods_in(over: set[int], round_: Round, observed: Observed, previous: Mapping[str, Any]) -> set[str]:
    return {uid for uid in round_.samples if shards_of(uid, round_, observed, previous) & over} if over else set()


def persisted_verdict(status: Mapping[str, Any]) -> Verdict | None:
    condition = find(status.get("conditions") or [], c.USAGE_HEALTHY)
    if condition is None:
        return None
    return Verdict(c.USAGE_HEALTHY, str(condition.get("status")), str(condition.get("reason")),
                   str(condition.get("message")))
