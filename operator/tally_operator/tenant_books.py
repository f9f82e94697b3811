"""PURE: one round booked into a service's books in their UsageShards (shards.py), and the shards to write.

The round is booked into the status's totals and into every shard, with one decision per pod; a shard is
written only when what it holds changed: its ledger, or its part of the budgets (budget.py, split by
shards.split_budgets)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tally_operator.samples import Counters
from tally_operator.shards import MAX_SHARD_TENANTS, Shard, shard_of, shard_rounds, totals_round
from tally_operator.usage import Booking, Ledger, Reading, Round, book, shard_status
from tally_runtime.contract import OTHER_TENANT


def book_sharded(totals: Ledger, shards: Mapping[int, Ledger], round_: Round, key: str,
                 untenanted: frozenset[str] = frozenset(), limits: Mapping[int, int] | None = None
                 ) -> tuple[Booking, dict[int, Booking]]:
    """The round booked into the status's totals and into every shard, with one decision per pod: a pod whose
    counters went down anywhere books nothing anywhere (shards.py). A pod the totals take as a baseline (an
    upgrade from a status without readings) is one in every shard; `untenanted`: pods whose reading kept no
    tenants (older still): a baseline in the shards, and what their totals rose by is booked to `other`, as
    before the shards. `limits`: the named tenants a shard full in bytes (shards.SHARD_ROOM_BYTES) may hold after
    the round; such a shard takes no new tenant from then on (`Ledger.closed`)."""
    limits = limits or {}
    totals, caught = caught_up(totals, shards, round_)
    # A shard lets a gone pod's reading go only once the totals hold it as gone (caught up, in a status that landed)
    present = round_.present if round_.present is not None else frozenset(round_.samples) | round_.failed
    following = frozenset(uid for uid, reading in totals.readings.items() if not reading.gone)
    rounds = shard_rounds(replace(round_, present=present | following), key, shards)
    baseline = untenanted | (frozenset() if totals.complete else frozenset(round_.samples) - set(totals.readings))
    down: frozenset[str] = frozenset()
    while True:
        booked = book(totals, totals_round(round_), down=down, tombstones=True)
        bookings = {index: book(shards.get(index, Ledger()), part, min(MAX_SHARD_TENANTS, limits.get(index,
                                                                                                 MAX_SHARD_TENANTS)),
                                down, baseline)
                    for index, part in rounds.items()}
        seen = frozenset(booked.regressed).union(*(b.regressed for b in bookings.values()))
        if seen <= down:
            break
        down = seen | down
    rest = Counters()
    for uid in sorted(untenanted - down):
        reading, sample = totals.readings.get(uid), round_.samples.get(uid)
        if reading is not None and sample is not None and sample.started == reading.epoch:
            rest = rest.plus(sample.counters.increase_since(reading.counters).tenant_part())
    if rest.any():
        index = shard_of(OTHER_TENANT, key)
        bookings[index] = with_other(bookings.get(index) or book(shards.get(index, Ledger()), Round({})), rest)
    booked = replace(booked, increase=booked.increase.plus(caught))
    # A shard's sequence and lost pods are the status's to count: a shard changes only with its tenants' books
    return booked, {index: replace(b, ledger=replace(b.ledger, sequence=0, unaccounted=0, complete=True,
                                                     closed=b.ledger.closed or index in limits))
                    for index, b in bookings.items()}


def caught_up(totals: Ledger, shards: Mapping[int, Ledger], round_: Round) -> tuple[Ledger, Counters]:
    """The totals brought up to what the shards booked, and what that adds (the tenant fields).

    The shards are written before the status, so a pass whose shard writes landed and whose status write did not
    (refused, or the operator died between them) leaves shards a round ahead of the totals: under the same epoch
    (a later reading), or under a later one (the pod restarted: those shards booked its new counters as new). The
    next reading of the pod made that up only while the pod lived on under the same epoch; a pod that ended or
    restarted first left that round in its tenants and not in the totals. So before every round each pod's total
    reading takes what its shard readings hold beyond it: every shard reading is one the pod gave, so the totals
    never pass what it served, and the tenants' sums equal the totals after every pass that lands. A pod the
    totals hold as gone was caught up as it went (usage.book's tombstones): the shards still holding it are
    letting it go, and a shard reading of a pod the totals do not hold at all is one they never knew."""
    if not totals.complete:  # after an upgrade the totals' first readings are a baseline (shards.py)
        return totals, Counters()
    held: dict[str, dict[float | None, Counters]] = {}
    for ledger in shards.values():
        for uid, part in ledger.readings.items():
            by_epoch = held.setdefault(uid, {})
            by_epoch[part.epoch] = by_epoch.get(part.epoch, Counters()).plus(part.counters.tenant_part())
    readings, added, lost = dict(totals.readings), Counters(), 0
    for uid, by_epoch in sorted(held.items()):
        reading = totals.readings.get(uid)
        if reading is not None and reading.gone:
            continue  # caught up as it went: the shards that still hold it are letting it go
        more = Counters()
        if reading is not None and reading.epoch in by_epoch:
            told, there = reading.counters.tenant_part(), by_epoch[reading.epoch]
            if not there.below(told):
                more = there.increase_since(told)
                readings[uid] = replace(reading, counters=reading.counters.plus(more))
        later = {epoch: c for epoch, c in by_epoch.items() if reading is None or epoch != reading.epoch}
        for counters in later.values():  # booked by shards as a new epoch's (or a new pod's) counters
            more = more.plus(counters)
        if later:
            newest = max(later, key=lambda epoch: epoch if epoch is not None else float("-inf"))
            readings[uid] = Reading(later[newest], newest, False, None)
            lost += 1 if reading is not None and not reading.final else 0
        added = added.plus(more)
    if not added.any() and readings == dict(totals.readings):
        return totals, added
    return replace(totals, readings=readings, totals=totals.totals.plus(added),
                   unaccounted=totals.unaccounted + lost), added


def with_other(booking: Booking, rest: Counters) -> Booking:
    ledger = booking.ledger
    tenants = {**ledger.tenants, OTHER_TENANT: ledger.tenants.get(OTHER_TENANT, Counters()).plus(rest)}
    increase = {**booking.tenant_increase,
                OTHER_TENANT: booking.tenant_increase.get(OTHER_TENANT, Counters()).plus(rest)}
    return replace(booking, ledger=replace(ledger, tenants=tenants, totals=ledger.totals.plus(rest)),
                   tenant_increase=increase)


def changed_shards(read: Mapping[int, Shard], ledgers: Mapping[int, Ledger],
                   budgets: Mapping[int, Mapping[str, Any]], rewrite: bool = False) -> dict[int, dict[str, Any]]:
    """Each shard whose ledger or budgets part differs from what was read (`rewrite`: every one, as when the
    books move into shards), as its body: `usage` and, where budgets apply, `budgets`."""
    out: dict[int, dict[str, Any]] = {}
    for index in sorted(set(read) | set(ledgers) | set(budgets)):
        shard = read.get(index)
        ledger = ledgers.get(index, shard.ledger if shard is not None else Ledger())
        body: dict[str, Any] = {"usage": shard_status(ledger)}
        if budgets.get(index):
            body["budgets"] = dict(budgets[index])
        # (a ledger read back equals the one it was written from: comparing them is cheaper than serializing)
        if rewrite or shard is None or shard.ledger != ledger or dict(shard.budgets) != body.get("budgets", {}):
            out[index] = body
    return out
