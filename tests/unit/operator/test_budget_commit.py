"""A platform Budget's round when its writes land only in part, and across a month's end (issue 59, items 3-5).

The Budget's round writes its BudgetShards, then its status; a status write refused (409: the Budget was edited,
a peer wrote) or an operator killed between the writes leaves the shards a round ahead. The retry plans on them.
Each test states the invariant per tenant as an expression and checks it after every round:

    Σ over services max(what its pods may still reach or spent, the slice it may be planning with) <= budget
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from tally_operator.budget_shards import BudgetShard, plan_round
from tally_operator.platform import parse_budget
from tally_operator.slices import ServiceReport, TenantReport

NOVEMBER = datetime.datetime(2026, 11, 30, 23, 0, tzinfo=datetime.UTC)
DECEMBER = datetime.datetime(2026, 12, 1, 0, 5, tzinfo=datetime.UTC)
BUDGET = 10_000


def budget() -> Any:
    return parse_budget({"metadata": {"name": "acme-month", "uid": "b-1",
                                      "creationTimestamp": "2026-11-01T00:00:00Z"},
                         "spec": {"services": {"namespaces": ["team-a", "team-b"]}, "unit": "tokens",
                                  "tenants": [{"name": "acme", "monthly": BUDGET}]}})


def round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value))


class Stored:
    """The Budget's status and shards as the API server holds them."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.shards: dict[int, BudgetShard] = {}

    def round(self, reports: dict[str, ServiceReport], now: datetime.datetime, status_lands: bool = True) -> Any:
        planned = plan_round(budget(), self.status, self.shards, reports, now, "key")
        for index, part in planned.writes.items():
            self.shards[index] = BudgetShard(round_trip(part), planned.seq, str(planned.seq))
        if status_lands:
            self.status = round_trip(planned.fields)
        return round_trip(planned.whole)


def slice_of(whole: dict[str, Any], uid: str) -> dict[str, int]:
    service = next(s for s in whole["services"] if s["uid"] == uid)
    return service["tenants"].get("acme", {"granted": 0, "ceiling": 0})


def report(uid: str, seq: int, period: str = "2026-11", spent: int = 0, held: int = 0, asked: int = 0
           ) -> ServiceReport:
    return ServiceReport("team-a" if uid == "a" else "team-b", uid, uid, period=period, seq=seq, pods=1,
                         tenants={"acme": TenantReport(spent=spent, held=held, asked=asked)})


def test_a_refused_status_write_never_lets_a_retry_grant_a_lowered_slice_twice() -> None:
    """A holds the month (granted 10,000) and has planned with it; B asks. The round lowers A (A has not seen it:
    its ceiling stays 10,000) and its shard lands, but the status write is refused. The retry reads the shard:
    it must still count A's ceiling, so B gets nothing A may still spend (it was 1.8x the budget)."""
    stored = Stored()
    first = stored.round({"a": report("a", 0, asked=BUDGET), "b": report("b", 0)}, NOVEMBER)
    seq_a = first["seq"]
    assert slice_of(first, "a")["granted"] == BUDGET
    # A planned with it; its pods hold 2,000 of it so far. B's requests wait for 8,000
    reports = {"a": report("a", seq_a, held=2_000), "b": report("b", seq_a, asked=8_000)}
    stored.round(reports, NOVEMBER + datetime.timedelta(minutes=1), status_lands=False)
    for attempt in range(3):  # the retries, on the shards as they landed
        whole = stored.round(reports, NOVEMBER + datetime.timedelta(minutes=2 + attempt))
        b = slice_of(whole, "b")
        # A never said it planned with a later slice than the 10,000: it may still lease all of it
        assert BUDGET + max(b["ceiling"], b["granted"]) <= BUDGET, (slice_of(whole, "a"), b)
    # Once A says it planned with the lowered slice (its pods holding 2,000), B gets the rest
    seen = {"a": report("a", whole["seq"], held=2_000), "b": report("b", whole["seq"], asked=8_000)}
    stored.round(seen, NOVEMBER + datetime.timedelta(minutes=6))
    after = stored.round(seen, NOVEMBER + datetime.timedelta(minutes=7))
    assert slice_of(after, "b")["granted"] == 8_000


def test_a_month_that_rolls_over_counts_what_a_lagging_services_pods_still_hold() -> None:
    """On the 30th A was lowered to nothing and planned with that, but its pods still hold 10,000 of leases
    (their take-back not confirmed yet). On the 1st, before A reports December, B asks for the whole budget: B
    may get only what A's pods cannot spend (it was 2.0x the budget)."""
    stored = Stored()
    first = stored.round({"a": report("a", 0, asked=BUDGET), "b": report("b", 0)}, NOVEMBER)
    # A's pods hold the whole slice; B asks; A is lowered...
    stored.round({"a": report("a", first["seq"], held=BUDGET), "b": report("b", first["seq"], asked=BUDGET)},
                 NOVEMBER + datetime.timedelta(minutes=1))
    lowered = stored.round({"a": report("a", first["seq"], held=BUDGET),
                            "b": report("b", first["seq"], asked=BUDGET)}, NOVEMBER + datetime.timedelta(minutes=2))
    seq = lowered["seq"]
    # ... and A plans with the lowered slice (its ceiling falls); its pods still hold the 10,000
    stored.round({"a": report("a", seq, held=BUDGET), "b": report("b", seq, asked=BUDGET)},
                 NOVEMBER + datetime.timedelta(minutes=3))
    december = stored.round({"a": report("a", seq, held=BUDGET),  # still November's books
                             "b": report("b", seq, period="2026-12", asked=BUDGET)}, DECEMBER)
    b = slice_of(december, "b")
    assert BUDGET + max(b["ceiling"], b["granted"]) <= BUDGET, b


def test_a_pass_on_a_spec_the_operator_refuses_carries_every_tenants_month_unchanged() -> None:
    """A spec refused (policy.allowedImages narrowed, say) still books what the pods serve, but cannot tell whether
    budgets apply: it must carry them as they are. It rewrote every shard without them: a tenant that had spent
    40,000 of 100,000 was charged its lifetime and refused for the month, and lost leases were forgiven."""
    from tenant_pods import Pod

    from tally_operator.bookkeeping import Observed, plan
    from tally_operator.budget import BudgetConfig, TenantBudget
    from tally_operator.observations import Observations
    from tally_operator.shards import Shard
    from tally_operator.usage import Round, ledger_from_status

    pod = Pod("pod-a")
    pod.serve("acme", 30_000, 10_000)
    config = BudgetConfig("total", TenantBudget(monthly_tokens=100_000))
    status: dict[str, Any] = {}
    shards: dict[int, Any] = {}

    def one_pass(budgets: BudgetConfig | None, keep: frozenset[str] | None) -> None:
        nonlocal status
        read = {i: Shard(ledger_from_status(body["usage"]), "1", body.get("budgets") or {})
                for i, body in shards.items()}
        planned = plan(status, Observations(), Observed(1, [], {}, Round({pod.uid: pod.sample()}), budgets=budgets,
                                                        serving=frozenset({pod.uid}), keep=keep, shards=read,
                                                        shard_key="k" * 32), "2026-12-06T12:00:00Z")
        shards.update({index: round_trip(body) for index, body in planned.shards.items()})
        status = round_trip(planned.status)

    one_pass(config, frozenset({"usage", "budgets"}))
    before = (json.dumps(status["budgets"], sort_keys=True), json.dumps(shards, sort_keys=True))
    assert any("budgets" in body and "acme" in body["budgets"].get("tenants", {}) for body in shards.values())
    one_pass(None, None)  # the spec refused: nothing applied, books kept (keep=None: every status key carried)
    assert (json.dumps(status["budgets"], sort_keys=True), json.dumps(shards, sort_keys=True)) == before
