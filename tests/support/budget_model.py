"""A model of the runtime's admission under leases (tally_runtime/budgets.py), for the budget tests: pods that
spend, ask and apply lease messages as the runtime does, and a round as reconcile.py plans it."""

from __future__ import annotations

import datetime
import json
import random
from typing import Any

from tally_operator.budget import (
    BudgetConfig,
    LeaseReport,
    Planned,
    budgets_status,
    counted,
    plan_budgets,
    state_from_status,
)
from tally_operator.samples import Counters, PodSample
from tally_operator.usage import Ledger, Round, book, ledger_from_status, ledger_status

NOW = datetime.datetime(2026, 12, 5, 12, 0, tzinfo=datetime.UTC)


class Pod:
    """A runtime as budgets.py admits: a request fits if the tenant's counter, what its requests in flight
    reserved and its cost stay within the lease (no lease message yet: nothing fits). Requests stay in flight
    for a while and bill at most what they reserved; lease messages apply only if numbered above the last,
    and may lower an allowance; /metrics say what the pod may still reach under the message it applied."""

    def __init__(self, uid: str, epoch: float, count: str = "total") -> None:
        self.uid, self.epoch, self.count = uid, epoch, count
        self.tenants: dict[str, Counters] = {}
        self.leases: dict[str, dict[str, Any]] | None = None
        self.starter: float | None = None
        self.seq = 0
        self.counter_at: dict[str, int] = {}
        self.wanted: dict[str, int] = {}  # tenant -> tokens asked for
        self.inflight: list[tuple[str, int, int]] = []  # (tenant, reserved, billed when it ends)
        self.clock = NOW.timestamp()  # unix seconds, as the test moves it
        self.period_end = 0.0  # of the last message: past it, its `unspent` refuses nothing

    def counter(self, tenant: str) -> int:
        return counted(self.tenants.get(tenant), self.count)

    def reserved(self, tenant: str) -> int:
        return sum(cost for t, cost, _ in self.inflight if t == tenant)

    def allowance(self, tenant: str) -> float | None:
        assert self.leases is not None
        lease = self.leases.get(tenant)
        return lease["allowance"] if lease is not None else self.starter

    def serve(self, tenant: str, cost: int, billed: int) -> bool:
        """Admit a request (it bills when it ends) or refuse it."""
        if self.leases is None:  # no lease message yet: it asks
            self.wanted[tenant] = max(self.wanted.get(tenant, 0), cost)
            return False
        allowance = self.allowance(tenant)
        counter, reserved = self.counter(tenant), self.reserved(tenant)
        if allowance is not None and counter + reserved + cost > allowance:
            unspent = (self.leases.get(tenant) or {}).get("unspent")
            month_over = bool(self.period_end) and self.clock >= self.period_end
            anywhere = None if unspent is None or month_over else \
                unspent - (counter - self.counter_at.get(tenant, 0)) - reserved
            if anywhere is None or cost <= anywhere:
                self.wanted[tenant] = max(self.wanted.get(tenant, 0), cost)  # asks for more here
            return False
        self.inflight.append((tenant, cost, billed))
        return True

    def settle(self, rng: random.Random, share: float = 0.5) -> dict[str, int]:
        """Some requests in flight end, billing what they generated: what each tenant was billed."""
        billed: dict[str, int] = {}
        ending = [r for r in self.inflight if rng.random() < share]
        for request in ending:
            self.inflight.remove(request)
            tenant, _, tokens = request
            self.tenants[tenant] = self.tenants.get(tenant, Counters()).plus(
                Counters(requests=1, prompt_tokens=tokens // 2, completion_tokens=tokens - tokens // 2))
            billed[tenant] = billed.get(tenant, 0) + tokens
        return billed

    def apply(self, message: dict[str, Any]) -> bool:
        if message["epoch"] != self.epoch or message["seq"] <= self.seq:
            return False
        self.leases, self.starter, self.seq = dict(message["tenants"]), message["starter"]["allowance"], message["seq"]
        self.period_end = float(message.get("periodEnd") or 0.0)
        self.counter_at = {t: self.counter(t) for t in self.leases}
        self.wanted = {}
        return True

    def sample(self, final: bool = False) -> PodSample:
        totals = Counters()
        for counters in self.tenants.values():
            totals = totals.plus(counters)
        reach = {t: max(lease["allowance"], self.counter(t) + self.reserved(t))
                 for t, lease in (self.leases or {}).items() if lease["allowance"] is not None}
        return PodSample(totals, "incremental", None, self.epoch, final, dict(self.tenants), pod_uid=self.uid,
                         wanted=dict(self.wanted), lease_seq=self.seq, reach=reach)


def round_trip(status: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(status))


def plan(config: BudgetConfig, before: Ledger, after: Ledger, budgets: dict[str, Any], serving: frozenset[str],
         samples: dict[str, PodSample], later: int = 0) -> Planned:
    """A round as reconcile.py plans it, from the samples it read (`later` seconds on)."""
    return plan_budgets(config, before, after, state_from_status(budgets), serving,
                        NOW + datetime.timedelta(seconds=later),
                        {uid: sample.wanted for uid, sample in samples.items()},
                        {uid: LeaseReport(s.lease_seq, s.reach) for uid, s in samples.items() if s.lease_seq})


def run_round(config: BudgetConfig, pods: dict[str, Pod], books: dict[str, Any], later: int = 0) -> Planned:
    """One round on every pod: read, book, plan, write (through JSON), deliver every message."""
    before = ledger_from_status(books.get("usage", {}))
    samples = {uid: p.sample() for uid, p in pods.items()}
    booking = book(before, Round(samples, present=frozenset(pods)))
    planned = plan(config, before, booking.ledger, books.get("budgets", {}), frozenset(pods), samples, later=later)
    books["usage"], books["budgets"] = round_trip(ledger_status(booking.ledger)), round_trip(
        budgets_status(planned, config))
    for uid, message in planned.messages.items():
        pods[uid].apply(round_trip(message))
    return planned


