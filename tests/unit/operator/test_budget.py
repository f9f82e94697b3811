"""Budgets across pods (budget.py): whatever the pods do between rounds (spend, die unread, begin again, miss
a scrape, appear), what a tenant spends in a period never exceeds its budget, and an active tenant can
spend nearly all of it."""

from __future__ import annotations

import datetime
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from budget_model import NOW, Pod, plan, round_trip, run_round

from tally_operator.budget import (
    BudgetConfig,
    LeaseReport,
    Planned,
    PodLease,
    TenantBudget,
    budgets_status,
    confirmed_lease,
    counted,
    plan_budgets,
    state_from_status,
)
from tally_operator.samples import Counters
from tally_operator.usage import Ledger, Reading, Round, book, ledger_from_status, ledger_status


def test_no_tenant_ever_spends_more_than_its_budget_across_pods_that_die_restart_and_miss_scrapes() -> None:
    rng = random.Random(38)
    config = BudgetConfig("total", TenantBudget(monthly_tokens=3_000), {"acme": TenantBudget(monthly_tokens=20_000),
                                                                         "tiny": TenantBudget(monthly_tokens=40)})
    tenants = ["acme", "tiny", *[f"new-{i}" for i in range(6)]]
    pods = {f"p{i}": Pod(f"p{i}", 1.0) for i in range(3)}
    spent = dict.fromkeys(tenants, 0)
    usage: dict[str, Any] = {}
    budgets: dict[str, Any] = {}
    late: list[tuple[str, dict[str, Any]]] = []
    next_pod = 3
    for step in range(400):
        for pod in pods.values():
            for tenant, billed in pod.settle(rng).items():
                spent[tenant] += billed
            for _ in range(rng.randint(0, 4)):
                tenant = rng.choice(tenants[: 2 + step // 60])  # new tenants appear over time
                cost = rng.randint(1, 300)
                pod.serve(tenant, cost, rng.randint(1, cost))
        event = rng.random()
        if event < 0.08:  # a pod killed, or restarted: what it served since its last reading is never booked
            victim = pods[rng.choice(sorted(pods))]
            for tenant, _, billed in victim.inflight:  # its clients got (up to) this much
                spent[tenant] += billed
            if event < 0.05:
                del pods[victim.uid]
                pods[f"p{next_pod}"] = Pod(f"p{next_pod}", float(next_pod))
                next_pod += 1
            else:  # a runtime begins its counters again (new epoch), forgetting its leases
                victim.epoch, victim.tenants, victim.leases, victim.seq, victim.inflight = \
                    victim.epoch + 0.5, {}, None, 0, []
        samples = {uid: pod.sample() for uid, pod in pods.items() if rng.random() < 0.85}
        before = ledger_from_status(usage)
        booking = book(before, Round(samples, frozenset(pods) - set(samples), present=frozenset(pods)))
        serving = frozenset(uid for uid in pods if rng.random() < 0.9)
        planned = plan(config, before, booking.ledger, budgets, serving, samples)
        usage = round_trip(ledger_status(booking.ledger))
        if rng.random() < 0.1:  # a peer's write on the same state lands first: its messages, not ours
            planned = plan(config, before, booking.ledger, budgets, serving, samples, later=1)
        budgets = round_trip(budgets_status(planned, config))
        late.extend(planned.messages.items())
        rng.shuffle(late)
        for _ in range(rng.randint(0, len(late))):  # messages arrive late, out of order, or never
            uid, message = late.pop()
            if uid in pods and rng.random() < 0.9:
                pods[uid].apply(round_trip(message))
        del late[50:]
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
    rng = random.Random(0)
    for _ in range(200):
        for pod in pods.values():
            spent += sum(pod.settle(rng, share=1.0).values())
            for _ in range(5):
                pod.serve("acme", 40, 40)
        for pod in pods.values():  # all ended before the last reading
            spent += sum(pod.settle(rng, share=1.0).values())
        before = ledger_from_status(usage)
        samples = {uid: p.sample() for uid, p in pods.items()}
        booking = book(before, Round(samples, present=frozenset(pods)))
        planned = plan(config, before, booking.ledger, budgets, frozenset(pods), samples)
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
    rng = random.Random(0)
    for day in (datetime.datetime(2026, 11, 30, 23, 59, tzinfo=datetime.UTC),) * 12 + (NOW,) * 3:
        pod.serve("acme", 10, 20)  # 10 completion tokens each (the other 10 are prompt, not counted)
        pod.settle(rng, share=1.0)
        sample = pod.sample()
        booking = book(ledger, Round({"a": sample}))
        planned = plan_budgets(config, ledger, booking.ledger, state, frozenset({"a"}), day, {"a": sample.wanted},
                               {"a": LeaseReport(sample.lease_seq, sample.reach)})
        crossings += [(planned.state.period, mark) for _, mark in planned.crossed]
        ledger, state = booking.ledger, planned.state
        for message in planned.messages.values():
            pod.apply(message)
    assert crossings == [("2026-11", 0.8), ("2026-11", 1.0)]
    assert state.period == "2026-12" and planned.tenants["acme"].spent <= 100


def test_an_idle_pods_allowance_is_taken_back_only_once_it_says_it_applied_the_lower_one() -> None:
    """One pod was leased the whole budget (its request asked for all of it); a second pod's tenant then asks.
    The idle pod is sent a lower allowance (none: it is idle), but the freed part is leased elsewhere only once
    the idle pod's /metrics report that message's number: a report of an earlier message (the lower one still
    on its way) frees nothing, since the pod may yet spend under what it holds."""
    config = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=900)})
    a, b = Pod("a", 1.0), Pod("b", 1.0)
    usage: dict[str, Any] = {}
    budgets: dict[str, Any] = {}

    def round_of(pods: dict[str, Pod], deliver: frozenset[str] = frozenset("ab")) -> Planned:
        nonlocal usage, budgets
        before = ledger_from_status(usage)
        samples = {uid: p.sample() for uid, p in pods.items()}
        booking = book(before, Round(samples, present=frozenset(pods)))
        planned = plan(config, before, booking.ledger, budgets, frozenset(pods), samples, later=len(usage))
        usage, budgets = round_trip(ledger_status(booking.ledger)), round_trip(budgets_status(planned, config))
        for uid, message in planned.messages.items():
            if uid in deliver:
                pods[uid].apply(round_trip(message))
        return planned

    both = {"a": a, "b": b}
    assert not a.serve("acme", 900, 900) and a.wanted == {"acme": 900}  # no lease yet: it asks (and waits)
    round_of({"a": a})
    assert a.allowance("acme") == 900  # what it asked for, all of the budget
    assert not b.serve("acme", 10, 10) and b.wanted == {"acme": 10}  # b appears, asks; a is idle
    lowering = round_of(both, deliver=frozenset("b"))  # a is to give all back (idle), not told yet
    assert lowering.messages["a"]["tenants"]["acme"]["allowance"] == 0  # type: ignore[index]
    assert lowering.tenants["acme"].reserved == 900  # a still counted whole
    assert b.leases is not None and b.leases["acme"]["unspent"] == 900  # not spent: it asks, not refused for good
    for _ in range(2):  # a reports the message before: nothing freed for b
        assert not b.serve("acme", 10, 10)
        again = round_of(both, deliver=frozenset("b"))
        assert again.tenants["acme"].reserved == 900 and b.allowance("acme") == 0
    assert not b.serve("acme", 10, 10)
    assert round_of(both).tenants["acme"].reserved == 900  # delivered now; confirmed in the next round
    assert a.allowance("acme") == 0 and b.allowance("acme") == 0
    assert not b.serve("acme", 10, 10)
    freed = round_of(both)
    assert b.allowance("acme") == 20 and freed.tenants["acme"].reserved == 20  # its ask, and as much headroom
    assert b.serve("acme", 10, 10)
    assert [lease["uid"] for lease in budgets["leases"] if lease["tenants"]] == ["b"]  # a's entry went


def test_a_pods_report_lowers_what_is_counted_only_for_the_last_message_sent_to_it() -> None:
    """A pod reporting an earlier message may still apply the last one (a raise on its way): its report says
    nothing of what it may reach then. Only a report of the last message, on the same epoch, lowers the count
    (never raises it)."""
    lease = PodLease(1.0, {"acme": 900, "zeta": 50}, None, seq=7)
    reading = Reading(Counters(), 1.0)
    assert confirmed_lease(lease, reading, LeaseReport(6, {"acme": 450})) == lease
    assert confirmed_lease(lease, Reading(Counters(), 2.0), LeaseReport(7, {"acme": 450})) == lease
    lowered = confirmed_lease(lease, reading, LeaseReport(7, {"acme": 450, "zeta": 80}))
    assert lowered.allowances == {"acme": 450, "zeta": 50}


ONE_ROUND = """
import sys
sys.path.insert(0, {here!r})
sys.path.insert(0, {support!r})
import test_budget as t
pods = {{f"pod-{{i}}": t.Pod(f"pod-{{i}}", 1.0) for i in range(8)}}
for pod in pods.values():
    pod.serve("acme", 10, 5)  # no lease yet: refused, and asked for
samples = {{uid: pod.sample() for uid, pod in pods.items()}}
empty = t.ledger_from_status({{}})
booked = t.book(empty, t.Round(samples, frozenset(), present=frozenset(pods))).ledger
config = t.BudgetConfig("total", None, {{"acme": t.TenantBudget(monthly_tokens=10_000)}})
print(list(t.plan(config, empty, booked, {{}}, frozenset(pods), samples).messages))
"""


def test_a_round_is_planned_the_same_whatever_the_hash_seed() -> None:
    """The serving pods come as a set: the grants, and the order of their messages, must not follow its
    iteration order, which changes with the hash seed (the simulation above once took another path so)."""
    script = ONE_ROUND.format(here=str(Path(__file__).parent), support=str(Path(__file__).parents[2] / "support"))
    orders = {subprocess.run([sys.executable, "-c", script], env={"PYTHONHASHSEED": str(seed), "PATH": ""},
                             capture_output=True, text=True, check=True, timeout=60).stdout
              for seed in range(1, 7)}
    assert len(orders) == 1 and "pod-0" in orders.pop()


def full_ledger(extra: dict[str, Counters] | None = None) -> Ledger:
    """A ledger holding its bound of named tenants (each spent a little), as after a busy month."""
    from tally_operator.usage import MAX_LEDGER_TENANTS

    tenants = {f"t{i:04d}": Counters(requests=1, prompt_tokens=1, completion_tokens=1)
               for i in range(MAX_LEDGER_TENANTS)}
    return Ledger(readings={"p0": Reading(Counters(), 1.0, False, {})}, tenants={**tenants, **(extra or {})})


def test_a_tenant_the_full_ledger_cannot_keep_apart_is_never_granted_anything() -> None:
    """The 1,001st tenant was booked to `other`; the planner read its spend (none) from the tenant map and
    granted it a whole budget every round: 12x its month in 3 minutes. Now its pods are told it is untracked."""
    config = BudgetConfig("total", TenantBudget(monthly_tokens=100))
    ledger = full_ledger()
    state: dict[str, Any] = {}
    for _ in range(5):
        planned = plan_budgets(config, ledger, ledger, state_from_status(state), frozenset({"p0"}), NOW,
                               {"p0": {"latecomer": 10}})
        state = round_trip(budgets_status(planned, config))
        told = planned.messages["p0"]["tenants"]["latecomer"]  # type: ignore[index]
        assert told["allowance"] == 0 and told["unspent"] == 0 and "cannot keep this tenant apart" in told["untracked"]
        assert "latecomer" not in planned.tenants
        assert all("latecomer" not in lease["tenants"] for lease in state["leases"])


def test_a_listed_tenant_is_never_told_it_has_no_budget() -> None:
    """A listed tenant that sorted after the plan's cut was sent `allowance: None`, which a pod reads as no budget
    (a 50M-token request admitted against 1,000); a pod naming 2,000 made-up tenants made the cut. Listed tenants
    come first now, and a tenant past the cut is told it is untracked, never unlimited."""
    from tally_operator.budget import MAX_ENTRIES

    config = BudgetConfig("total", TenantBudget(monthly_tokens=10), {"zzz-listed": TenantBudget(monthly_tokens=1000)})
    ledger = Ledger(readings={"p0": Reading(Counters(), 1.0, False, {})})
    flood = dict.fromkeys((f"made-up-{i:05d}" for i in range(MAX_ENTRIES + 500)), 10)
    planned = plan_budgets(config, ledger, ledger, state_from_status({}), frozenset({"p0"}), NOW, {"p0": flood})
    tenants = planned.messages["p0"]["tenants"]
    assert isinstance(tenants, dict)
    assert tenants["zzz-listed"]["allowance"] is not None and "untracked" not in tenants["zzz-listed"]
    assert all(entry["allowance"] is not None for entry in tenants.values())
    assert sum("untracked" in entry for entry in tenants.values()) >= 500


def test_a_count_changed_mid_month_applies_from_the_next_month() -> None:
    """Changing budgets.count mid-month read the month's start (counted in the old units) in the new ones and
    forgot the spend: 1.9x the budget was served. The count in force holds until the month ends."""
    tenant = Counters(requests=10, prompt_tokens=600, completion_tokens=300)
    ledger = Ledger(readings={"p0": Reading(tenant, 1.0, False, {"acme": tenant})}, tenants={"acme": tenant})
    total = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=1000)})
    state = round_trip(budgets_status(plan_budgets(total, Ledger(), Ledger(), state_from_status({}), frozenset(),
                                                   NOW), total))
    planned = plan_budgets(total, ledger, ledger, state_from_status(state), frozenset({"p0"}), NOW)
    state = round_trip(budgets_status(planned, total))
    assert state["tenants"]["acme"]["spent"] == 900
    completion = BudgetConfig("completion", None, {"acme": TenantBudget(monthly_tokens=1000)})
    planned = plan_budgets(completion, ledger, ledger, state_from_status(state), frozenset({"p0"}),
                           NOW + datetime.timedelta(days=1))
    status = round_trip(budgets_status(planned, completion))
    assert status["count"] == "total" and status["pendingCount"] == "completion"
    assert status["tenants"]["acme"]["spent"] == 900  # not 300 - 900 read as nothing spent
    assert planned.messages["p0"]["count"] == "total"
    next_month = plan_budgets(completion, ledger, ledger, state_from_status(status), frozenset({"p0"}),
                              datetime.datetime(2027, 1, 2, tzinfo=datetime.UTC))
    status = round_trip(budgets_status(next_month, completion))
    assert status["count"] == "completion" and "pendingCount" not in status and status["tenants"]["acme"]["spent"] == 0


def test_a_request_larger_than_any_pods_part_is_served_when_it_fits_what_the_tenant_has_left() -> None:
    """Shares were equal per active pod (at most budget / pods): a 6,000-token request with 10,000 of 10,000 left
    on two pods was refused for ever. Now the pod asks for what it needs and the round grants it."""
    config = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=10_000)})
    pods = {"a": Pod("a", 1.0), "b": Pod("b", 1.0)}
    books: dict[str, Any] = {}
    run_round(config, pods, books)
    assert not pods["a"].serve("acme", 6_000, 5_000) and pods["a"].wanted == {"acme": 6_000}
    run_round(config, pods, books, later=1)
    assert pods["a"].serve("acme", 6_000, 5_000)
    assert not pods["b"].serve("acme", 10_001, 1) and not pods["b"].wanted  # more than the budget: refused
    assert not pods["b"].serve("acme", 4_500, 4_500) and pods["b"].wanted == {"acme": 4_500}  # fits, once a's ends
    run_round(config, pods, books, later=2)
    assert not pods["b"].serve("acme", 4_500, 4_500)  # a's reservation still holds all but 4,000: it waits
    pods["a"].settle(random.Random(0), share=1.0)  # a's request ends, billing 5,000 of its 6,000
    run_round(config, pods, books, later=3)
    assert pods["b"].serve("acme", 4_500, 4_500)
    pods["b"].settle(random.Random(0), share=1.0)
    last = run_round(config, pods, books, later=4)
    assert last.tenants["acme"].spent == 9_500 and last.tenants["acme"].unspent == 500


def test_headroom_follows_demand_and_an_idle_pod_keeps_none() -> None:
    """What is left beyond the asks is headroom weighted by what each pod spent since the round before: the busy
    pod holds more, the idle one gives back what it held (it asks again when a request comes)."""
    config = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=100_000)})
    pods = {"busy": Pod("busy", 1.0), "idle": Pod("idle", 1.0)}
    books: dict[str, Any] = {}
    for pod in pods.values():
        pod.serve("acme", 500, 500)  # both ask
    run_round(config, pods, books)
    assert pods["busy"].allowance("acme") == pods["idle"].allowance("acme") == 1_000  # ask + twice the ask
    for later in range(1, 4):
        while pods["busy"].serve("acme", 100, 100):
            pass
        pods["busy"].settle(random.Random(0), share=1.0)
        run_round(config, pods, books, later=later)
    busy = (pods["busy"].allowance("acme") or 0) - pods["busy"].counter("acme")
    assert busy >= 1_000 and pods["idle"].allowance("acme") == 0


def test_requests_that_wait_for_allowance_spend_nearly_the_whole_budget_and_never_more() -> None:
    """The real node's case, modelled: two pods, a 3,000-token budget, 100 requests of one tenant reserving 90
    tokens and billing 60 to 90. A request that does not fit here waits (rounds come when a pod asks) instead of
    being refused; one is refused only when it does not fit what the tenant has left anywhere."""
    rng = random.Random(7)
    config = BudgetConfig("total", None, {"acme": TenantBudget(monthly_tokens=3_000)})
    pods = {"a": Pod("a", 1.0), "b": Pod("b", 1.0)}
    books: dict[str, Any] = {}
    waiting = {uid: [rng.randint(60, 90) for _ in range(50)] for uid in pods}
    spent, refused, later = 0, 0, 0
    while any(waiting.values()) and later < 200:
        for uid, pod in pods.items():
            still = []
            for billed in waiting[uid]:
                if pod.serve("acme", 90, billed):
                    continue
                if pod.leases is not None and "acme" not in pod.wanted:  # not asked for: refused for good
                    refused += 1
                else:
                    still.append(billed)
            waiting[uid] = still
            spent += sum(pod.settle(rng).values())
        later += 1
        run_round(config, pods, books, later=later)
    for pod in pods.values():
        spent += sum(pod.settle(rng, share=1.0).values())
    run_round(config, pods, books, later=later + 1)
    assert spent <= 3_000 and spent >= 0.95 * 3_000, spent
    assert books["budgets"]["tenants"]["acme"]["spent"] == spent
    assert not any(waiting.values()) and refused > 0  # everyone had an answer; the last ones did not fit


def test_a_budget_in_credits_counts_each_kind_of_token_at_its_weight_and_tells_the_pods() -> None:
    """Credits weigh prompt, cached prompt and completion tokens apart (whole numbers): the ledger's counters are
    counted so, and the lease message names the weights the pod must count its own counter with."""
    from tally_operator.budget import is_unit

    label = "credits:2,1,8"
    assert counted(Counters(prompt_tokens=100, cached_tokens=30, completion_tokens=10), label) == 2 * 70 + 30 + 80
    assert is_unit(label) and is_unit("total") and not is_unit("credits:1,2") and not is_unit("credits:-1,1,1")
    config = BudgetConfig(label, None, {"acme": TenantBudget(monthly_tokens=1_000)})
    pod = Pod("a", 1.0)
    pod.serve("acme", 100, 100)
    books: dict[str, Any] = {}
    planned = run_round(config, {"a": pod}, books)
    message = planned.messages["a"]
    assert message["count"] == "credits" and message["weights"] == {"prompt": 2, "cachedPrompt": 1, "completion": 8}
    assert books["budgets"]["count"] == label and state_from_status(books["budgets"]).count == label
