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
from dataclasses import dataclass
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
from tally_operator.status import build_status, without_times
from tally_operator.usage import Booking, Round, book, ledger_from_status, ledger_status, round_status
from tally_operator.verdict import judge


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


@dataclass(frozen=True, slots=True)
class Plan:
    status: dict[str, Any]
    changed: bool
    transitions: list[Condition]
    observations: Observations  # to keep once the status is written
    booking: Booking | None = None
    verdict: Verdict | None = None
    budgets: Planned | None = None  # the leases to send once the status holding them has landed


def plan(previous: Mapping[str, Any], observations: Observations, observed: Observed, now: str) -> Plan:
    verdicts = list(observed.verdicts)
    fields = dict(observed.fields)
    booking, usage_verdict = None, None
    budgets: Planned | None = None
    if observed.round is not None:
        ledger = ledger_from_status(previous.get("usage") or {})
        fresh = following(observations, ledger, persisted_verdict(previous))
        booking = book(ledger, observed.round)
        observations = advance(fresh, ledger, booking, observed.round)
        usage_verdict, observations = judge(observations, observed.round, observed.max_mismatch_ratio)
        verdicts.append(usage_verdict)
        fields["usage"] = {**ledger_status(booking.ledger), **round_status(observed.round, now)}
        if observed.budgets is not None:
            budgets = plan_budgets(observed.budgets, ledger, booking.ledger,
                                   state_from_status(previous.get("budgets") or {}), observed.serving,
                                   datetime.datetime.strptime(now, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC),
                                   {uid: s.wanted for uid, s in observed.round.samples.items() if s.wanted},
                                   {uid: LeaseReport(s.lease_seq, s.reach) for uid, s in observed.round.samples.items()
                                    if s.lease_seq})
            fields["budgets"] = budgets_status(budgets, observed.budgets)
    status = build_status(previous, verdicts, now, observed.generation, fields, observed.keep)
    return Plan(status=status, changed=without_times(status) != without_times(previous),
                transitions=transitions(previous.get("conditions") or [], status["conditions"]),
                observations=observations, booking=booking, verdict=usage_verdict, budgets=budgets)


def persisted_verdict(status: Mapping[str, Any]) -> Verdict | None:
    condition = find(status.get("conditions") or [], c.USAGE_HEALTHY)
    if condition is None:
        return None
    return Verdict(c.USAGE_HEALTHY, str(condition.get("status")), str(condition.get("reason")),
                   str(condition.get("message")))
