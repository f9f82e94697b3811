"""The books in UsageShards (shards.py, bookkeeping.plan): every round planned against the status and the shards
as persisted (through JSON), written shards first and then the status, as books.commit does; a pass whose
writes land only in part (the operator dies between them) is followed by one that starts from what landed.
What the clients were served is summed apart and compared with the books, exactly."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from tenant_pods import Pod

from tally_operator import shards as sharding
from tally_operator.bookkeeping import Observed, plan
from tally_operator.budget import BudgetConfig, TenantBudget
from tally_operator.observations import Observations
from tally_operator.samples import Counters
from tally_operator.shards import SHARDS, Shard, merged, shard_of, split_ledger, totals_ledger
from tally_operator.usage import Ledger, Round, book, ledger_from_status, ledger_status
from tally_runtime.contract import OTHER_TENANT

NOW = "2026-12-06T12:00:00Z"


class Store:
    """The API server's copies: the status and each shard with its resourceVersion, as JSON."""

    def __init__(self, status: dict[str, Any] | None = None) -> None:
        self.status: dict[str, Any] = status or {}
        self.shards: dict[int, tuple[str, int]] = {}
        self.version = 0
        self.largest = 0

    def observed(self, round_: Round, budgets: BudgetConfig | None = None) -> Observed:
        read = {index: Shard(ledger_from_status(json.loads(body)["usage"]), str(rv),
                             json.loads(body).get("budgets") or {})
                for index, (body, rv) in self.shards.items()}
        return Observed(1, [], {}, round_, budgets=budgets, serving=frozenset(round_.samples), shards=read,
                        shard_key="k" * 32)

    def commit(self, round_: Round, land_shards: int | None = None, budgets: BudgetConfig | None = None) -> Any:
        """One pass; `land_shards`: the operator dies after that many shard writes (no status write)."""
        planned = plan(json.loads(json.dumps(self.status)), Observations(), self.observed(round_, budgets), NOW)
        for n, (index, usage) in enumerate(sorted(planned.shards.items())):
            if land_shards is not None and n >= land_shards:
                return planned
            body = json.dumps(usage, separators=(",", ":"))
            self.largest = max(self.largest, len(body))
            self.version += 1
            self.shards[index] = (body, self.version)
        if land_shards is None:
            self.status = json.loads(json.dumps(planned.status))
        return planned

    def tenants(self) -> dict[str, Counters]:
        out: dict[str, Counters] = {}
        for body, _ in self.shards.values():
            for name, counters in ledger_from_status(json.loads(body)["usage"]).tenants.items():
                out[name] = out.get(name, Counters()).plus(counters)
        return out

    def totals(self) -> Counters:
        return ledger_from_status(self.status["usage"]).totals


def tenant_part(counters: dict[str, Counters]) -> dict[str, Counters]:
    return {name: c.tenant_part() for name, c in counters.items() if c.any()}


def test_many_tenants_book_exactly_into_small_shards_and_a_status_without_tenants() -> None:
    """2,000 tenants over 10 pods (200 each): every tenant's books equal what it was served, the shards' sums
    equal the status's totals, the status holds no tenant, and no shard comes near 256 KiB."""
    rng = random.Random(5)
    pods = [Pod(f"pod-{i}") for i in range(10)]
    served: dict[str, Counters] = {}
    store = Store()
    for _ in range(3):
        for i, pod in enumerate(pods):
            for t in range(200):
                tenant = f"tenant-{i * 200 + t:05d}"
                got = pod.serve(tenant, rng.randint(1, 900), rng.randint(1, 300))
                served[tenant] = served.get(tenant, Counters()).plus(got)
        store.commit(Round({p.uid: p.sample() for p in pods}))
    assert store.tenants() == tenant_part(served)
    summed = Counters()
    for counters in served.values():
        summed = summed.plus(counters)
    assert store.totals().tenant_part() == summed.tenant_part()
    usage = store.status["usage"]
    assert "tenants" not in usage and usage["tenantCount"] == 2000
    assert all("tenants" not in pod for pod in usage["pods"])
    assert len(json.dumps(store.status)) < 8 << 10
    assert 30 <= len(store.shards) <= SHARDS and store.largest < 64 << 10


def test_a_pass_that_dies_between_its_writes_is_followed_exactly() -> None:
    """Seeded interleavings: a pass lands some of its shard writes and dies before the status; the next pass
    starts from what landed. Pods drain (final) and are replaced meanwhile. Nothing is booked twice or lost."""
    rng = random.Random(11)
    names = [f"t{i}" for i in range(300)]
    pods = {f"pod-{i}": Pod(f"pod-{i}") for i in range(4)}
    served: dict[str, Counters] = {}
    store, next_pod = Store(), 4
    died = 0
    for step in range(60):
        for pod in pods.values():
            for _ in range(rng.randint(0, 30)):
                tenant = rng.choice(names)
                served[tenant] = served.get(tenant, Counters()).plus(pod.serve(tenant, rng.randint(1, 50),
                                                                               rng.randint(1, 50)))
        round_ = Round({uid: p.sample() for uid, p in pods.items()})
        if rng.random() < 0.3:
            planned = store.commit(round_, land_shards=rng.randint(0, 6))
            died += bool(planned.shards)
            continue
        store.commit(round_)
        if step % 9 == 8:  # a pod drains: its final counters were just booked; it leaves, a new one comes
            leaving = rng.choice(sorted(pods))
            store.commit(Round({uid: p.sample(final=uid == leaving) for uid, p in pods.items()}))
            del pods[leaving]
            pods[f"pod-{next_pod}"] = Pod(f"pod-{next_pod}", epoch=float(next_pod))
            next_pod += 1
            store.commit(Round({uid: p.sample() for uid, p in pods.items()}))
    store.commit(Round({uid: p.sample() for uid, p in pods.items()}))
    assert died > 5
    assert store.tenants() == tenant_part(served)
    assert store.status["usage"]["podsUnaccounted"] == 0
    summed = Counters()
    for counters in served.values():
        summed = summed.plus(counters)
    assert store.totals().tenant_part() == summed.tenant_part()


def test_a_pod_whose_counters_went_down_in_one_shard_books_nothing_anywhere() -> None:
    """One decision per pod: a pod whose counter for one tenant reads lower than its shard's reading (a runtime
    back from a journal that lagged) books nothing in any shard nor in the totals, and counts as unaccounted."""
    pod = Pod("pod-a")
    a, b = "alpha", next(f"b{i}" for i in range(100) if shard_of(f"b{i}", "k" * 32) != shard_of("alpha", "k" * 32))
    pod.serve(a, 10, 10)
    pod.serve(b, 10, 10)
    store = Store()
    store.commit(Round({pod.uid: pod.sample()}))
    pod.tenants[a] = Counters(requests=0, prompt_tokens=5, completion_tokens=5)  # went down
    pod.serve(b, 10, 10)  # b went up
    planned = store.commit(Round({pod.uid: pod.sample()}))
    assert planned.booking.regressed == ("pod-a",)
    assert store.tenants()[b].completion_tokens == 10  # not 20: nothing booked anywhere this round
    assert store.totals().completion_tokens == 20
    assert store.status["usage"]["podsUnaccounted"] == 1


def test_the_status_before_shards_moves_into_them_once_and_an_interrupted_move_leaves_nothing_behind() -> None:
    """A status that kept its tenants (the layout before shards) moves them into shards on its first round; a
    move that died after some shard writes, and whose next pass draws another hash key, still books exactly:
    the shards the first attempt wrote are emptied."""
    pods = [Pod("pod-a"), Pod("pod-b")]
    served: dict[str, Counters] = {}
    for i, pod in enumerate(pods):
        for t in range(150):
            served[f"t{t}"] = served.get(f"t{t}", Counters()).plus(pod.serve(f"t{t}", i + 1, t + 1))
    old = book(Ledger(), Round({p.uid: p.sample() for p in pods})).ledger
    store = Store({"usage": json.loads(json.dumps(ledger_status(old)))})
    store.commit(Round({p.uid: p.sample() for p in pods}), land_shards=10)  # dies mid-move
    assert "tenants" in store.status["usage"] and len(store.shards) == 10
    for pod in pods:
        served["t0"] = served["t0"].plus(pod.serve("t0", 1, 1))
    planned = plan(json.loads(json.dumps(store.status)), Observations(),
                   Observed(1, [], {}, Round({p.uid: p.sample() for p in pods}), shards={
                       index: Shard(ledger_from_status(json.loads(body)["usage"]), str(rv))
                       for index, (body, rv) in store.shards.items()}, shard_key="another-key"), NOW)
    assert set(store.shards) <= set(planned.shards)  # every shard the first attempt wrote is written again
    for index, usage in planned.shards.items():
        store.shards[index] = (json.dumps(usage), 99)
    store.status = json.loads(json.dumps(planned.status))
    assert store.status["usage"]["shardKey"] == "another-key" and "tenants" not in store.status["usage"]
    assert store.tenants() == tenant_part(served)


def test_split_and_merged_give_back_the_ledger() -> None:
    pods = [Pod("pod-a"), Pod("pod-b")]
    for pod in pods:
        for t in range(40):
            pod.serve(f"t{t}", 3, 4)
    ledger = book(Ledger(), Round({p.uid: p.sample() for p in pods})).ledger
    parts = split_ledger(ledger, "key")
    whole = merged(totals_ledger(ledger), parts)
    assert whole.tenants == ledger.tenants
    assert {uid: r.tenants for uid, r in whole.readings.items()} == \
        {uid: r.tenants for uid, r in ledger.readings.items()}
    # keyed: placement follows the key
    assert sum(shard_of(f"t{t}", "key") != shard_of(f"t{t}", "other-key") for t in range(40)) > 30


def test_a_full_shard_folds_to_other_and_a_budget_refuses_the_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant whose shard is full is booked to `other` (its totals kept), and never granted under a budget:
    its pods are told it is untracked."""
    monkeypatch.setattr(sharding, "MAX_SHARD_TENANTS", 2)
    monkeypatch.setattr("tally_operator.tenant_books.MAX_SHARD_TENANTS", 2)
    key = "k" * 32
    same = sorted([name for name in (f"n{i}" for i in range(2000)) if shard_of(name, key) == 0][:3])
    pod = Pod("pod-a")
    for name in same:
        pod.serve(name, 1, 1)
    store = Store()
    config = BudgetConfig("total", TenantBudget(monthly_tokens=1000))
    asking = replace(pod.sample(), wanted={same[2]: 5})
    planned = store.commit(Round({pod.uid: asking}), budgets=config)
    books = store.tenants()
    assert set(books) == {same[0], same[1], OTHER_TENANT} and books[OTHER_TENANT].completion_tokens == 1
    assert store.status["usage"]["tenantsFolded"] == 1
    told = planned.budgets.messages["pod-a"]["tenants"]  # type: ignore[union-attr]
    assert told[same[2]]["allowance"] == 0 and "cannot keep this tenant apart" in told[same[2]]["untracked"]


def test_statuses_from_before_readings_and_before_tenant_readings_keep_their_sums_when_they_move() -> None:
    """A status with totals but no readings (its pods are a baseline once) and one whose readings kept no
    tenants (what they rose by goes to `other`): after the move the tenants sum to the totals, round after
    round."""
    pod = Pod("pod-a")
    pod.serve("alpha", 50, 100)
    store = Store({"usage": {"requests": 9, "promptTokens": 0, "completionTokens": 90}})
    store.commit(Round({pod.uid: pod.sample()}))
    assert store.totals().completion_tokens == 90 and store.tenants() == {OTHER_TENANT: Counters(
        requests=9, completion_tokens=90)}
    pod.serve("alpha", 0, 3)
    store.commit(Round({pod.uid: pod.sample()}))
    assert store.tenants()["alpha"].completion_tokens == 3 and store.totals().completion_tokens == 93

    older = {"usage": {"requests": 5, "completionTokens": 50, "tenants": {OTHER_TENANT: {
        "requests": 5, "completionTokens": 50}}, "pods": [{"uid": "pod-b", "epoch": 1.0, "requests": 5,
                                                            "completionTokens": 50}]}}
    other_pod = Pod("pod-b")
    other_pod.tenants = {"beta": Counters(requests=6, completion_tokens=60)}
    store = Store(older)
    store.commit(Round({"pod-b": other_pod.sample()}))
    assert store.tenants() == {OTHER_TENANT: Counters(requests=6, completion_tokens=60)}  # 10 more, unexplained
    other_pod.serve("beta", 0, 5)
    store.commit(Round({"pod-b": other_pod.sample()}))
    books = store.tenants()
    assert books["beta"].completion_tokens == 5 and store.totals().completion_tokens == 65
    assert sum(c.completion_tokens for c in books.values()) == 65


def test_the_budgets_of_thousands_of_tenants_live_in_the_shards_and_read_back_whole() -> None:
    """3,000 tenants under a default budget (past the 2,000 the status could plan before): every one is planned
    and leased, none refused as untracked; the status keeps no tenant, the shards keep their views, period
    starts and each pod's allowances, and the next round reads back exactly the state the last one planned."""
    from tally_operator.budget import state_from_status
    from tally_operator.shards import join_budgets

    config = BudgetConfig("total", TenantBudget(monthly_tokens=100))
    pods = [Pod(f"pod-{i}") for i in range(4)]
    names = [f"t{i:04d}" for i in range(3000)]
    for i, pod in enumerate(pods):
        for name in names[i * 750:(i + 1) * 750]:
            pod.serve(name, 5, 5)
    store = Store()
    asking = Round({p.uid: replace(p.sample(), wanted=dict.fromkeys(p.tenants, 20)) for p in pods})
    first = store.commit(asking, budgets=config)
    assert first.budgets is not None and len(first.budgets.tenants) == 3000
    assert not any(told.get("untracked") for message in first.budgets.messages.values()
                   for told in message["tenants"].values())  # type: ignore[attr-defined]
    assert all(message["tenants"][name]["allowance"] >= 10 + 20  # type: ignore[index]  # the ask, granted
               for pod, message in zip(pods, first.budgets.messages.values(), strict=True) for name in pod.tenants)
    kept = store.status["budgets"]
    assert "tenants" not in kept and kept["tenantCount"] == 3000 and all("tenants" not in lease
                                                                          for lease in kept["leases"])
    assert len(json.dumps(store.status)) < 8 << 10
    parts = [json.loads(body).get("budgets") or {} for body, _ in store.shards.values()]
    assert sum(len(part.get("tenants", {})) for part in parts) == 3000
    assert state_from_status(join_budgets(kept, parts)) == first.budgets.state
    pods[0].serve("t0000", 5, 5)  # spend counts from the round the budgets first applied
    second = store.commit(Round({p.uid: p.sample() for p in pods}), budgets=config)
    assert second.budgets is not None and second.budgets.tenants["t0000"].spent == 10
