"""A platform Budget over two services (platform.py, slices.py): each service leases its pods within its slice
as budget.py does, and the Budget moves slices to where requests wait. Whatever the order of the services'
rounds and the Budget's, late lease messages and a month's end, a tenant never spends more than its budget
across the services, and requests that wait for allowance spend nearly all of it."""

from __future__ import annotations

import datetime
import random
from typing import Any

from budget_model import Pod, round_trip

from tally_operator.budget import LeaseReport, budgets_status, plan_budgets, state_from_status
from tally_operator.budget_shards import BudgetShard, joined_status, plan_round
from tally_operator.platform import budgets_in_force, parse_budget
from tally_operator.slices import plan_slices, report_of, slices_status, state_from_budget_status
from tally_operator.usage import Round, book, ledger_from_status, ledger_status

NOVEMBER = datetime.datetime(2026, 11, 30, 23, 0, tzinfo=datetime.UTC)
DECEMBER = datetime.datetime(2026, 12, 1, 0, 30, tzinfo=datetime.UTC)


def budget_object(monthly: int, default: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"services": {"namespaces": ["team-a", "team-b"]}, "unit": "tokens",
                            "tenants": [{"name": "acme", "monthly": monthly}]}
    if default is not None:
        spec["default"] = {"monthly": default}
    return {"metadata": {"name": "acme-month", "uid": "b-1", "creationTimestamp": "2026-11-01T00:00:00Z"},
            "spec": spec, "status": {}}


class Service:
    """A covered CompletionService: its pods, and its status (usage and budgets) through JSON, as written."""

    def __init__(self, namespace: str, name: str, pods: int, authenticated: bool = True) -> None:
        self.namespace, self.name, self.uid = namespace, name, f"{namespace}-{name}"
        self.pods = {f"{self.uid}-p{i}": Pod(f"{self.uid}-p{i}", 1.0) for i in range(pods)}
        self.authenticated = authenticated
        self.usage: dict[str, Any] = {}
        self.budgets: dict[str, Any] = {}
        self.late: list[tuple[str, dict[str, Any]]] = []
        self.sent: dict[str, dict[str, Any]] = {}  # the last round's messages

    def round(self, budget: dict[str, Any], now: datetime.datetime, rng: random.Random) -> None:
        config, _ = budgets_in_force(None, self.authenticated, self.namespace, self.name, self.uid, {},
                                     [parse_budget(budget)], len(self.pods), now)
        assert config is not None
        before = ledger_from_status(self.usage)
        samples = {uid: p.sample() for uid, p in self.pods.items()}
        booking = book(before, Round(samples, present=frozenset(self.pods)))
        planned = plan_budgets(config, before, booking.ledger, state_from_status(self.budgets), frozenset(self.pods),
                               now, {uid: s.wanted for uid, s in samples.items()},
                               {uid: LeaseReport(s.lease_seq, s.reach) for uid, s in samples.items() if s.lease_seq})
        self.usage = round_trip(ledger_status(booking.ledger))
        self.budgets = round_trip(budgets_status(planned, config))
        self.sent = dict(planned.messages)
        self.late.extend(planned.messages.items())
        rng.shuffle(self.late)
        while self.late and rng.random() < 0.8:  # most arrive at once; some late, out of order
            uid, message = self.late.pop()
            self.pods[uid].apply(round_trip(message))

    def obj(self) -> dict[str, Any]:
        return {"metadata": {"namespace": self.namespace, "name": self.name, "uid": self.uid},
                "status": {"budgets": self.budgets, "readyReplicas": len(self.pods)}}


def budget_round(budget: dict[str, Any], services: list[Service], now: datetime.datetime) -> None:
    parsed = parse_budget(budget)
    reports = {s.uid: report_of(s.obj(), parsed.name, True, "") for s in services}
    planned = plan_slices(parsed, state_from_budget_status(budget["status"]), reports, now)
    budget["status"] = round_trip(slices_status(planned))


class ShardedBudget:
    """The Budget as the API server holds it with its tenants in BudgetShards (budget_shards.plan_round), and
    what a service's cache of it shows: the status as written and, now and then, a shard's version before."""

    def __init__(self, budget: dict[str, Any], lag: float) -> None:
        self.obj, self.lag = budget, lag
        self.shards: dict[int, BudgetShard] = {}
        self.before: dict[int, BudgetShard] = {}
        self.whole: dict[str, Any] = {}
        self.spec = budget["spec"]

    def round(self, services: list[Service], now: datetime.datetime) -> None:
        parsed = parse_budget(self.obj)
        reports = {s.uid: report_of(s.obj(), parsed.name, True, "") for s in services}
        planned = plan_round(parsed, self.obj["status"], self.shards, reports, now, "key")
        for index, part in planned.writes.items():
            if index in self.shards:
                self.before[index] = self.shards[index]
            self.shards[index] = BudgetShard(round_trip(part), planned.seq, "rv")
        self.obj["status"] = round_trip(planned.fields)
        self.whole = round_trip(planned.whole)

    def seen(self, rng: random.Random) -> dict[str, Any]:
        view = {index: self.before[index] if index in self.before and rng.random() < self.lag else shard
                for index, shard in self.shards.items()}
        return {**self.obj, "status": joined_status(self.obj["status"], view)}


def run_month(budget: dict[str, Any], services: list[Service], now: datetime.datetime, rng: random.Random,
              requests: int, tenant: str = "acme", steps: int = 400,
              sharded: ShardedBudget | None = None) -> tuple[int, int]:
    """`requests` of one tenant spread over every pod, each waiting (as the runtime holds it) until served or
    refused for not fitting what the tenant has left anywhere. Returns (spent, refused). `sharded`: the Budget's
    tenants in its shards, which services may see a version behind."""
    pods = [p for s in services for p in s.pods.values()]
    waiting: dict[str, list[int]] = {p.uid: [] for p in pods}
    for i in range(requests):
        waiting[pods[i % len(pods)].uid].append(rng.randint(60, 90))
    limit = next(t["monthly"] for t in budget["spec"]["tenants"] if t["name"] == tenant)
    spent, refused = 0, 0
    for pod in pods:
        pod.clock = now.timestamp()
    for step in range(steps):
        for pod in pods:
            still = []
            for billed in waiting[pod.uid]:
                if pod.serve(tenant, 90, billed):
                    continue
                if pod.leases is not None and tenant not in pod.wanted:  # does not fit what is left anywhere
                    refused += 1
                else:
                    still.append(billed)
            waiting[pod.uid] = still
            spent += pod.settle(rng).get(tenant, 0)
        assert spent <= limit, (step, spent)
        rounds = [*(("service", s) for s in services), ("budget", None)]
        rng.shuffle(rounds)
        for kind, service in rounds:
            if kind == "budget":
                sharded.round(services, now) if sharded is not None else budget_round(budget, services, now)
            elif service is not None and rng.random() < 0.9:  # a service's round comes late now and then
                service.round(sharded.seen(rng) if sharded is not None else budget, now, rng)
        if not any(waiting.values()) and not any(p.inflight for p in pods):
            break
    for pod in pods:  # everything in flight ends and is booked
        spent += sum(pod.settle(rng, share=1.0).values())
    for service in services:
        service.round(sharded.seen(rng) if sharded is not None else budget, now, rng)
    sharded.round(services, now) if sharded is not None else budget_round(budget, services, now)
    assert spent <= limit
    assert not any(waiting.values()), "a request neither served nor refused"
    return spent, refused


def test_one_tenants_month_across_two_services_never_exceeds_the_budget_and_is_nearly_all_spent() -> None:
    rng = random.Random(53)
    budget = budget_object(6_000)
    services = [Service("team-a", "chat", 2), Service("team-b", "code", 2)]
    spent, refused = run_month(budget, services, DECEMBER, rng, requests=100)
    view = budget["status"]["tenants"]["acme"]
    assert spent >= 0.95 * 6_000 and refused > 0, (spent, refused)
    assert view["spent"] == spent and view["budget"] == 6_000  # the Budget's books are the clients' sums
    per_service = [s.budgets["tenants"]["acme"]["spent"] for s in services]
    assert sum(per_service) == spent and all(per_service), per_service  # both services served the tenant


def test_a_month_rolls_over_with_the_slices_and_the_new_month_gets_its_whole_budget() -> None:
    rng = random.Random(7)
    budget = budget_object(3_000)
    services = [Service("team-a", "chat", 2), Service("team-b", "code", 1)]
    november, _ = run_month(budget, services, NOVEMBER, rng, requests=60)
    assert 0.95 * 3_000 <= november <= 3_000 and budget["status"]["period"] == "2026-11"
    december, _ = run_month(budget, services, DECEMBER, rng, requests=60)
    assert 0.95 * 3_000 <= december <= 3_000 and budget["status"]["period"] == "2026-12"
    assert budget["status"]["tenants"]["acme"]["spent"] == december


def test_a_service_that_leaves_keeps_its_slice_counted_for_the_month() -> None:
    """Its pods may have spent up to its slice under leases no Budget round will see again: that much is
    retired (counted as spent) until the month ends, and the other service cannot be granted it."""
    rng = random.Random(3)
    budget = budget_object(2_000)
    a, b = Service("team-a", "chat", 1), Service("team-b", "code", 1)
    pods = [*a.pods.values(), *b.pods.values()]
    for _ in range(4):
        for pod in pods:
            pod.serve("acme", 700, 700)  # asks, and once leased is served (and stays in flight)
        for service in (a, b):
            service.round(budget, DECEMBER, rng)
        budget_round(budget, [a, b], DECEMBER)
    assert all(pod.inflight for pod in pods)
    granted_a = next(s for s in budget["status"]["services"] if s["uid"] == a.uid)["tenants"]["acme"]["ceiling"]
    assert granted_a >= 700
    budget_round(budget, [b], DECEMBER)  # a is gone (deleted, or no longer covered)
    status = budget["status"]
    assert status["retired"]["acme"] == granted_a
    assert status["tenants"]["acme"]["remaining"] <= 2_000 - granted_a
    assert [s["uid"] for s in status["services"]] == [b.uid]


def test_where_tenants_are_not_authenticated_the_budget_serves_nothing_it_covers() -> None:
    """Without API keys a client names its own tenant: the service's pods refuse every tenant the Budget covers
    (listed, and with a default every other), saying why, and the condition says so."""
    budget = budget_object(1_000, default=100)
    service = Service("team-a", "chat", 1, authenticated=False)
    config, verdict = budgets_in_force(None, False, "team-a", "chat", service.uid, {}, [parse_budget(budget)], 1,
                                       DECEMBER)
    assert config is not None and verdict is not None
    assert (verdict.status, verdict.reason) == ("False", "TenantsNotAuthenticated")
    pod = next(iter(service.pods.values()))
    pod.serve("acme", 10, 10)
    service.round(budget, DECEMBER, random.Random(0))
    for _, message in service.late:  # every message delivered
        pod.apply(round_trip(message))
    assert pod.leases is not None and pod.seq
    assert "not authenticated" in pod.leases["acme"]["untracked"]
    assert not pod.serve("acme", 10, 10) and not pod.serve("anyone", 10, 10)
    starter = service.sent[pod.uid]["starter"]
    assert starter["allowance"] == 0 and "not authenticated" in starter["untracked"]


def test_a_service_covered_by_a_budget_ignores_its_own_spec_budgets_and_the_older_budget_wins() -> None:
    from tally_operator.budget import BudgetConfig, TenantBudget

    own = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=10**9)})
    older, newer = budget_object(1_000), budget_object(5_000)
    newer["metadata"] = {"name": "later", "uid": "b-2", "creationTimestamp": "2026-11-05T00:00:00Z"}
    config, verdict = budgets_in_force(own, True, "team-a", "chat", "u", {}, [parse_budget(newer),
                                                                             parse_budget(older)], 1, DECEMBER)
    assert config is not None and verdict is not None
    assert config.source == "Budget/acme-month" and config.tenants["acme"].monthly_tokens == 0  # no slice yet
    assert "later also covers it" in verdict.message and "spec.budgets is ignored" in verdict.message
    uncovered, why = budgets_in_force(own, True, "team-c", "chat", "u", {}, [parse_budget(older)], 1, DECEMBER)
    assert uncovered is own and why is not None and why.reason == "SpecBudgets"


def test_a_budget_with_its_tenants_in_shards_that_services_see_a_version_behind_never_overspends() -> None:
    """The Budget's tenants live in BudgetShards, each rewritten only when it changed; a service's cache shows
    the status as written but, half the time, a shard's version before it. Whatever it sees, the tenant never
    spends more than its budget, still spends nearly all of it, and the Budget's books are the clients' sums."""
    rng = random.Random(29)
    budget = budget_object(6_000)
    sharded = ShardedBudget(budget, lag=0.5)
    services = [Service("team-a", "chat", 2), Service("team-b", "code", 2)]
    spent, refused = run_month(budget, services, DECEMBER, rng, requests=100, sharded=sharded)
    assert spent >= 0.95 * 6_000 and refused > 0, (spent, refused)
    assert "tenants" not in budget["status"] and budget["status"]["tenantCount"] == 1
    assert sharded.whole["tenants"]["acme"]["spent"] == spent


def test_a_service_that_sees_a_shard_behind_says_it_planned_with_no_later_slices_than_that_shards() -> None:
    """The number a service reports (`budgetSeq`) tells the Budget which lowered slices it has applied. A cache
    that shows a shard older than the status says was written must not let it claim the status's number: it
    claims the shard's (saying less is safe: the Budget keeps counting the higher slices of later changes)."""
    budget = budget_object(1_000)
    budget["status"] = {"period": "2026-12", "seq": 9, "shardSeqs": {"3": 9, "5": 4},
                        "services": [{"namespace": "team-a", "name": "chat", "uid": "team-a-chat", "seq": 9,
                                      "applied": True, "pods": 1}], "tenantCount": 1, "exhausted": 0}
    current = BudgetShard({"services": {"team-a-chat": {"acme": {"granted": 300, "ceiling": 300, "spent": 0}}}}, 9)
    older = BudgetShard({"services": {"team-a-chat": {"acme": {"granted": 700, "ceiling": 700, "spent": 0}}}}, 7)
    ahead = BudgetShard({}, 10)  # written by a round whose status did not land

    def seen(shards: dict[int, BudgetShard]) -> tuple[int, int | None]:
        obj = {**budget, "status": joined_status(budget["status"], shards)}
        config, _ = budgets_in_force(None, True, "team-a", "chat", "team-a-chat", {}, [parse_budget(obj)], 1,
                                     DECEMBER)
        assert config is not None
        return config.seq, config.tenants["acme"].monthly_tokens

    assert seen({3: current, 5: BudgetShard({}, 4)}) == (9, 300)
    assert seen({3: older, 5: BudgetShard({}, 4)}) == (7, 700)  # the higher slice, and the number it came with
    assert seen({3: current, 5: ahead}) == (9, 300)
    assert seen({3: current}) == (9, 300)  # a shard not seen yet holds nothing this service could plan with


def test_a_budget_over_ten_thousand_tenants_keeps_a_small_status_and_shards_under_256_kib() -> None:
    """10,000 tenants under a default budget across two services: every tenant's month and slices are in the
    Budget's shards, none over 256 KiB, the status keeps the services and a count; read back whole, it is what
    was planned."""
    import json

    from tally_operator.shards import MAX_SHARD_BYTES
    from tally_operator.slices import ServiceReport, TenantReport

    budget = budget_object(1_000, default=5_000)
    parsed = parse_budget(budget)
    names = [f"tenant-{i:05d}" for i in range(10_000)]

    def reports() -> dict[str, ServiceReport]:
        return {uid: ServiceReport("team-a" if uid == "a" else "team-b", uid, uid, period="2026-12", pods=2,
                                   tenants={t: TenantReport(spent=10, asked=50) for t in names})
                for uid in ("a", "b")}

    first = plan_round(parsed, {}, {}, reports(), DECEMBER, "key")
    shards = {i: BudgetShard(round_trip(part), first.seq, "1") for i, part in first.writes.items()}
    assert len(shards) >= 60
    assert max(len(json.dumps(part, separators=(",", ":"))) for part in first.writes.values()) < MAX_SHARD_BYTES
    status = round_trip(first.fields)
    assert "tenants" not in status and status["tenantCount"] == 10_001 and len(json.dumps(status)) < 16 << 10
    assert joined_status(status, shards)["tenants"] == round_trip(first.whole)["tenants"]
    again = plan_round(parsed, status, shards, reports(), DECEMBER, "key")  # read back, planned on again
    assert again.previous["tenants"] == round_trip(first.whole)["tenants"] and again.seq > first.seq
