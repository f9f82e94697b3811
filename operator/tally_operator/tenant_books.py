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
from tally_operator.usage import Booking, Ledger, Round, book, shard_status
from tally_runtime.contract import OTHER_TENANT


def book_sharded(totals: Ledger, shards: Mapping[int, Ledger], round_: Round, key: str,
                 untenanted: frozenset[str] = frozenset()) -> tuple[Booking, dict[int, Booking]]:
    """The round booked into the status's totals and into every shard, with one decision per pod: a pod whose
    counters went down anywhere books nothing anywhere (shards.py). A pod the totals take as a baseline (an
    upgrade from a status without readings) is one in every shard; `untenanted`: pods whose reading kept no
    tenants (older still): a baseline in the shards, and what their totals rose by is booked to `other`, as
    before the shards."""
    rounds = shard_rounds(round_, key, shards)
    baseline = untenanted | (frozenset() if totals.complete else frozenset(round_.samples) - set(totals.readings))
    down: frozenset[str] = frozenset()
    while True:
        booked = book(totals, totals_round(round_), down=down)
        bookings = {index: book(shards.get(index, Ledger()), part, MAX_SHARD_TENANTS, down, baseline)
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
    # A shard's sequence and lost pods are the status's to count: a shard changes only with its tenants' books
    return booked, {index: replace(b, ledger=replace(b.ledger, sequence=0, unaccounted=0, complete=True))
                    for index, b in bookings.items()}


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
