"""Budgets across pods (budget.py): whatever the pods do between rounds (spend, die unread, begin again, miss
a scrape, appear), what a tenant spends in a period never exceeds its budget, and an active tenant can
spend nearly all of it."""

from __future__ import annotations

import datetime
import json
import random
from typing import Any

from tally_operator.budget import (
    BudgetConfig,
    TenantBudget,
    budgets_status,
    counted,
    plan_budgets,
    state_from_status,
)
from tally_operator.samples import Counters, PodSample
from tally_operator.usage import Ledger, Round, book, ledger_from_status, ledger_status

NOW = datetime.datetime(2026, 12, 5, 12, 0, tzinfo=datetime.UTC)


class Pod:
    """A runtime as budgets.py admits: a request fits if the tenant's counter plus its cost is within the
    lease (the lease of a tenant not listed is the starter; no lease message yet: nothing fits)."""

    def __init__(self, uid: str, epoch: float, count: str = "total") -> None:
        self.uid, self.epoch, self.count = uid, epoch, count
        self.tenants: dict[str, Counters] = {}
        self.leases: dict[str, float | None] | None = None
        self.starter: float | None = None
        self.wanted: set[str] = set()
        self.exhausted: dict[str, bool] = {}

    def allowance(self, tenant: str) -> float | None:
        assert self.leases is not None
        return self.leases.get(tenant, self.starter) if tenant in self.leases else self.starter

    def serve(self, tenant: str, cost: int, billed: int) -> int:
        if self.leases is None:
            return 0
        have = self.tenants.get(tenant, Counters())
        allowance = self.allowance(tenant)
        if allowance is not None and counted(have, self.count) + cost > allowance:
            if not self.exhausted.get(tenant, False):
                self.wanted.add(tenant)  # refused for want of allowance here: asks for more
            return 0
        self.tenants[tenant] = have.plus(Counters(requests=1, prompt_tokens=billed // 2,
                                                  completion_tokens=billed - billed // 2))
        return billed

    def apply(self, message: dict[str, Any]) -> None:
        if message["epoch"] != self.epoch:
            return
        leases = {t: lease["allowance"] for t, lease in message["tenants"].items()}
        for tenant, before in (self.leases or {}).items():  # an allowance only rises within an epoch
            if before is not None and leases.get(tenant) is not None:
                leases[tenant] = max(before, leases[tenant])
        self.leases, self.starter = leases, message["starter"]["allowance"]
        self.exhausted = {t: bool(lease.get("exhausted")) for t, lease in message["tenants"].items()}
        self.wanted = set()

    def sample(self, final: bool = False) -> PodSample:
        totals = Counters()
        for counters in self.tenants.values():
            totals = totals.plus(counters)
        return PodSample(totals, "incremental", None, self.epoch, final, dict(self.tenants), pod_uid=self.uid,
                         wanted=frozenset(self.wanted))


def round_trip(status: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(status))


def test_no_tenant_ever_spends_more_than_its_budget_across_pods_that_die_restart_and_miss_scrapes() -> None:
    rng = random.Random(38)
    config = BudgetConfig("total", TenantBudget(monthly_tokens=3_000), {"acme": TenantBudget(monthly_tokens=20_000),
                                                                         "tiny": TenantBudget(monthly_tokens=40)})
    tenants = ["acme", "tiny", *[f"new-{i}" for i in range(6)]]
    pods = {f"p{i}": Pod(f"p{i}", 1.0) for i in range(3)}
    spent = dict.fromkeys(tenants, 0)
    usage: dict[str, Any] = {}
    budgets: dict[str, Any] = {}
    next_pod = 3
    for step in range(400):
        for pod in pods.values():
            for _ in range(rng.randint(0, 4)):
                tenant = rng.choice(tenants[: 2 + step // 60])  # new tenants appear over time
                cost = rng.randint(1, 300)
                spent[tenant] += pod.serve(tenant, cost, rng.randint(1, cost))
        event = rng.random()
        if event < 0.05:  # a pod killed unread: what it spent since its last reading is real, never booked
            del pods[rng.choice(sorted(pods))]
            pods[f"p{next_pod}"] = Pod(f"p{next_pod}", float(next_pod))
            next_pod += 1
        elif event < 0.08:  # a runtime begins its counters again (new epoch), forgetting its leases
            victim = pods[rng.choice(sorted(pods))]
            victim.epoch, victim.tenants, victim.leases = victim.epoch + 0.5, {}, None
        samples = {uid: pod.sample() for uid, pod in pods.items() if rng.random() < 0.85}
        before = ledger_from_status(usage)
        booking = book(before, Round(samples, frozenset(pods) - set(samples), present=frozenset(pods)))
        serving = frozenset(uid for uid in pods if rng.random() < 0.9)
        wanted = {uid: sample.wanted for uid, sample in samples.items()}
        planned = plan_budgets(config, before, booking.ledger, state_from_status(budgets), serving, NOW, wanted)
        usage = round_trip(ledger_status(booking.ledger))
        budgets = round_trip(budgets_status(planned, config))
        for uid, message in planned.messages.items():
            if rng.random() < 0.9:  # some lease messages are lost
                pods[uid].apply(round_trip(message))
        for tenant in tenants:
            limit = config.of(tenant)
            assert limit is not None and limit.monthly_tokens is not None
            assert spent[tenant] <= limit.monthly_tokens, (step, tenant, spent[tenant])
    # budgets were usable (a pod killed unread costs its whole outstanding lease for the month), and held
    assert spent["acme"] > 0.3 * 20_000 and spent["tiny"] <= 40
    assert all(spent[t] > 0 for t in tenants[2:])  # tenants the ledger did not know asked, and were served


def test_an_active_tenant_can_spend_nearly_its_whole_budget() -> None:
    config = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=10_000)})
    pods = {"a": Pod("a", 1.0), "b": Pod("b", 1.0)}
    usage: dict[str, Any] = {}
    budgets: dict[str, Any] = {}
    spent = 0
    for _ in range(200):
        for pod in pods.values():
            for _ in range(5):
                spent += pod.serve("acme", 40, 40)
        before = ledger_from_status(usage)
        samples = {uid: p.sample() for uid, p in pods.items()}
        booking = book(before, Round(samples, present=frozenset(pods)))
        planned = plan_budgets(config, before, booking.ledger, state_from_status(budgets), frozenset(pods), NOW,
                               {uid: sample.wanted for uid, sample in samples.items()})
        usage, budgets = round_trip(ledger_status(booking.ledger)), round_trip(budgets_status(planned, config))
        for uid, message in planned.messages.items():
            pods[uid].apply(round_trip(message))
    assert 9_900 <= spent <= 10_000
    view = budgets["tenants"]["acme"]
    assert view["spent"] == spent and view["budget"] == 10_000 and view["remaining"] + view["reserved"] + spent \
        == 10_000


def test_a_new_month_starts_the_spend_again_and_crossings_are_reported_once() -> None:
    config = BudgetConfig("completion", None, {"acme": TenantBudget(monthly_tokens=100)})
    pod = Pod("a", 1.0, count="completion")
    ledger, state = Ledger(), state_from_status({})
    crossings = []
    for day in (datetime.datetime(2026, 11, 30, 23, 59, tzinfo=datetime.UTC),) * 12 + (NOW,) * 3:
        pod.serve("acme", 10, 20)  # 10 completion tokens each (the other 10 are prompt, not counted)
        sample = pod.sample()
        booking = book(ledger, Round({"a": sample}))
        planned = plan_budgets(config, ledger, booking.ledger, state, frozenset({"a"}), day, {"a": sample.wanted})
        crossings += [(planned.state.period, mark) for _, mark in planned.crossed]
        ledger, state = booking.ledger, planned.state
        for message in planned.messages.values():
            pod.apply(message)
    assert crossings == [("2026-11", 0.8), ("2026-11", 1.0)]
    assert state.period == "2026-12" and planned.tenants["acme"].spent <= 100
