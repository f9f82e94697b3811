"""The money path under seeded schedules: the real pass (`books.commit`: read the status and the UsageShards, scrape,
plan, write the shards and then the status by compare-and-swap, then what follows a landed write) against an API
server in memory (memory_api.py), while a seeded scheduler serves requests on pods, drains and kills them, lets
other writers move the object on, answers 409 or 500 at any write and kills the operator before or after any write.
Tenant names are hostile: 128 characters, most of them outside ASCII.

After every step the books are checked as expressions, against what the simulated pods served (what their clients
were told):
- never more: every tenant's line, and the totals, at most what was served;
- the sums: after a pass that landed, the tenants' lines (every shard) sum to the totals, field by field;
- exact: once no pod was killed unread, a pass that lands books exactly what was served, tenant by tenant (a tenant
  folded to `other` in its part; `other` holds exactly what the folded ones were served);
- booking never stops: with the faults off, the next pass lands.

A failure names its seed; `TALLY_SIM_SEED=<seed> pytest tests/unit/operator/test_money_simulation.py` replays it
(and `TALLY_SIM_SCHEDULES=<n>` runs more)."""

from __future__ import annotations

import asyncio
import json
import os
import random
from typing import Any

import pytest
from memory_api import MemoryApi
from money_world import NAMESPACE, World, faults, hostile_names, new_world

from tally_operator import constants as c
from tally_operator.kube import KubeError
from tally_operator.samples import Counters
from tally_runtime.contract import OTHER_TENANT


async def schedule(seed: int, steps: int = 40) -> World:
    """One seeded schedule: its steps, then the faults off and one pass that must land."""
    world = new_world(seed, tenants=random.Random(seed).choice([5, 40, 400]))
    rng = world.rng
    for _ in range(steps):
        action = rng.random()
        if action < 0.45:
            world.serve(rng.randint(0, 60))
        elif action < 0.55 and len(world.pods) < 8:
            world.add_pod()
        elif action < 0.62 and world.pods:  # a pod drains: read final, acknowledged, gone after a pass that landed
            world.draining.add(rng.choice(sorted(world.pods)))
        elif action < 0.66 and world.pods:  # killed unread (SIGKILL, a node lost): its tail may be lost
            uid = rng.choice(sorted(world.pods))
            world.pods.pop(uid)
            world.draining.discard(uid)
            world.killed_unread += 1
        elif action < 0.72:  # another writer moves the object on (a label, kopf's annotations)
            world.api.touch(c.KIND, NAMESPACE, "chat")
        else:
            world.api.fault = faults(rng, rate=rng.choice([0.0, 0.05, 0.2]))
            landed = await world.run_pass(failing=rng.choice([0.0, 0.2]))
            world.api.fault = None
            world.check(landed)
            if landed:  # a drained pod whose final reading landed exits
                _, whole = world.books()
                for uid in [u for u in world.draining if whole.readings.get(u) and whole.readings[u].final]:
                    world.draining.discard(uid)
                    world.pods.pop(uid)
    for _ in range(2):  # with the faults off, booking goes on at once
        assert await world.run_pass(), "a pass with no faults did not land"
    world.check(True)
    totals, _ = world.books()  # and a pod that went has left the status (its reading as persisted, CRD-pruned)
    assert set(totals.readings) <= set(world.pods), sorted(set(totals.readings) - set(world.pods))
    return world


def seeds() -> list[int]:
    if os.environ.get("TALLY_SIM_SEED"):
        return [int(os.environ["TALLY_SIM_SEED"])]
    return list(range(int(os.environ.get("TALLY_SIM_SCHEDULES", "120"))))


def test_the_books_hold_under_seeded_schedules_of_faults_crashes_and_hostile_names() -> None:
    failures = []
    for seed in seeds():
        try:
            asyncio.run(schedule(seed))
        except AssertionError as error:
            failures.append(f"seed {seed}: {error!r}"[:500])
    assert not failures, f"{len(failures)} schedule(s) broke the books (replay: TALLY_SIM_SEED=<seed>):\n" + \
        "\n".join(failures[:5])


# -- scenarios of issue 59, each failing on the code before it ---------------------------------------------------------


def test_a_namesakes_leftover_shards_never_stop_the_new_services_books() -> None:
    """A service deleted with --cascade=orphan leaves its UsageShards; a namesake (another uid) created after it
    books into its own, and every token its pods serve is booked."""
    async def run() -> None:
        world = new_world(7, tenants=200)
        for index in range(64):  # the old service's shards, under the names shards had before the uid was in them
            world.api.create({"apiVersion": c.API_VERSION, "kind": c.SHARD_KIND,
                              "metadata": {"name": f"chat-usage-{index:02d}", "namespace": NAMESPACE,
                                           "labels": {c.LABEL_SHARD_OWNER: "svc-old"},
                                           "ownerReferences": [{"apiVersion": c.API_VERSION, "kind": c.KIND,
                                                                "name": "chat", "uid": "svc-old", "controller": True}]},
                              "service": "chat", "shard": index, "usage": {"completionTokens": 5}})
        world.serve(400)
        assert await world.run_pass()
        world.check(True)
        _, whole = world.books()
        assert whole.totals.completion_tokens > 0 and len(whole.tenants) > 50
    asyncio.run(run())


def test_long_non_ascii_names_over_many_pods_are_booked_exactly_and_no_shard_passes_the_bound() -> None:
    """5,000 tenants of 128 characters (CJK and emoji: 3-4 bytes each as stored, 6-12 escaped) over 20 pods, each
    serving 1,000 of them: every tenant booked exactly, no write refused, no shard above its bound (each name was
    written once per pod reading: the first round's shards were over 300 KiB and refused, and every pass after)."""
    async def run() -> None:
        world = new_world(3, tenants=0)
        world.names = hostile_names(world.rng, 5000)
        world.pods = {}
        for _ in range(20):
            world.add_pod()
        for i, pod in enumerate(world.pods.values()):
            for name in world.names[(i * 200) % 5000:(i * 200) % 5000 + 1000]:
                got = pod.serve(name, 10, 5)
                world.served[name] = world.served.get(name, Counters()).plus(got)
        assert await world.run_pass()
        world.check(True)
        largest = max(len(raw.encode()) for (kind, _, _), raw in world.api.objects.items() if kind == c.SHARD_KIND)
        assert largest < 768 << 10
        _, whole = world.books()
        assert OTHER_TENANT not in whole.tenants  # none folded: each shard holds its names once
    asyncio.run(run())


@pytest.mark.parametrize("fresh_names", [True, False], ids=["new-names-every-round", "the-same-names"])
def test_a_shard_full_in_bytes_takes_no_new_tenant_and_the_books_go_on(monkeypatch: pytest.MonkeyPatch,
                                                                       fresh_names: bool) -> None:
    """With a small byte bound, new tenants past it go to `other`; rounds go on landing and stay exact."""
    monkeypatch.setattr("tally_operator.bookkeeping.SHARD_ROOM_BYTES", 6 << 10)

    async def run() -> None:
        world = new_world(5, tenants=300)
        for step in range(6):
            if fresh_names:
                world.names = hostile_names(random.Random(step), 300)
            world.serve(300)
            assert await world.run_pass()
            world.check(True)
        _, whole = world.books()
        assert OTHER_TENANT in whole.tenants and whole.tenants_folded > 0
        assert any(reason == "TenantsFolded" for _, reason, _ in world.posted.events)
    asyncio.run(run())


def test_a_pod_whose_round_would_pass_the_hard_bound_waits_and_the_others_are_booked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that would pass the hard bound is not written: the pods that would grow it wait (booked later, an
    Event says why), every other pod's round lands."""
    monkeypatch.setattr("tally_operator.bookkeeping.MAX_SHARD_BYTES", 4 << 10)
    monkeypatch.setattr("tally_operator.shard_store.MAX_SHARD_BYTES", 4 << 10)

    async def run() -> None:
        world = new_world(9, tenants=300)
        world.serve(2000)
        assert await world.run_pass()
        world.check(True)
        assert any(reason == "UsageRoundDeferred" for _, reason, _ in world.posted.events)
        totals, _ = world.books()
        assert set(totals.readings) < set(world.pods)  # someone waits
        monkeypatch.undo()  # room again (a bound raised; the pods' tenants spread): booked, exactly
        assert await world.run_pass()
        world.check(True)
        totals, _ = world.books()
        assert set(totals.readings) == set(world.pods)
    asyncio.run(run())


def test_a_shard_name_taken_by_another_object_is_reported_and_the_rest_is_booked() -> None:
    async def run() -> None:
        world = new_world(11, tenants=12)
        world.serve(40)
        assert await world.run_pass()
        names = {raw for (kind, _, name), raw in world.api.objects.items() if kind == c.SHARD_KIND}
        assert names
        # the same uid's shard names, one not yet created, taken by something that is not this service's
        taken = f"chat-usage-{world.meta['uid']}-"
        free = next(i for i in range(64)
                    if (c.SHARD_KIND, NAMESPACE, f"{taken}{i:02d}") not in world.api.objects)
        world.api.create({"apiVersion": c.API_VERSION, "kind": c.SHARD_KIND,
                          "metadata": {"name": f"{taken}{free:02d}", "namespace": NAMESPACE,
                                       "labels": {c.LABEL_SHARD_OWNER: "someone"}},
                          "service": "chat", "shard": free, "usage": {}})
        world.names = hostile_names(random.Random(12), 2000)
        world.serve(500)
        assert await world.run_pass()
        world.check(True)
        assert any(reason == "UsageShardNameTaken" for _, reason, _ in world.posted.events)
    asyncio.run(run())


def test_an_over_long_tenant_label_is_refused_at_the_edge() -> None:
    from tally_operator.samples import MetricsParseError, parse_sample
    from tally_runtime import contract

    text = "\n".join([
        f"# TYPE {contract.REQUESTS} counter", f'{contract.REQUESTS}_total{{endpoint="completions"}} 1',
        f"# TYPE {contract.START_TIME} gauge", f"{contract.START_TIME} 5",
        f"# TYPE {contract.BUDGET_WANTED} gauge", f'{contract.BUDGET_WANTED}{{tenant="{"x" * 3000}"}} 5', ""])
    with pytest.raises(MetricsParseError, match="3000 characters"):
        parse_sample(text)


def test_json_of_a_round_trip() -> None:
    """The in-memory API server stores what it is given through JSON, with its own resourceVersion."""
    api = MemoryApi()
    made = api.create({"apiVersion": "v1", "kind": "X", "metadata": {"name": "a", "namespace": "n"}, "n": 1})
    with pytest.raises(KubeError) as refused:
        api.replace({**made, "metadata": {**made["metadata"], "resourceVersion": "0"}})
    assert refused.value.status == 409
    assert json.loads(api.objects[("X", "n", "a")])["n"] == 1


def test_under_a_default_budget_long_names_are_kept_and_a_full_shard_keeps_what_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a default budget each pod's allowances repeated every name once per pod: 10,000 tenants of 128 CJK
    characters over 50 pods made every shard pass its bound on the first round, and a shard past it took no new
    name at all (all 50,000 folded). Names are written once per shard now (the allowances too), and a shard that
    grows past its bound keeps as many of its new names as fit."""
    from tenant_pods import Pod

    from tally_operator.bookkeeping import Observed, plan
    from tally_operator.budget import BudgetConfig, TenantBudget
    from tally_operator.observations import Observations
    from tally_operator.shards import Shard, shard_bytes
    from tally_operator.usage import Round, ledger_from_status

    rng = random.Random(8)
    names = hostile_names(rng, 3000)
    pods = [Pod(f"pod-{p}") for p in range(20)]
    for p, pod in enumerate(pods):
        for name in names[p * 150 % 3000:p * 150 % 3000 + 300]:
            pod.serve(name, 7, 3)
    config = BudgetConfig("total", TenantBudget(monthly_tokens=10**6))

    def first_round() -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        samples = {pod.uid: pod.sample() for pod in pods}
        planned = plan({}, Observations(), Observed(1, [], {}, Round(samples, present=frozenset(samples)),
                                                    budgets=config, serving=frozenset(samples), shard_key="k" * 32),
                       "2026-12-06T12:00:00Z")
        return planned.status, {i: json.loads(json.dumps(body)) for i, body in planned.shards.items()}

    status, shards = first_round()
    assert status["usage"]["tenantsFolded"] == 0 and status["usage"]["tenantCount"] == 3000
    assert max(shard_bytes(body) for body in shards.values()) < 512 << 10
    assert all("leaseNames" in body["budgets"] for body in shards.values() if body.get("budgets", {}).get("leases"))
    read = {i: Shard(ledger_from_status(body["usage"]), "1", body.get("budgets") or {}) for i, body in shards.items()}
    from tally_operator.shards import join_budgets
    joined = join_budgets(status["budgets"], [shard.budgets for shard in read.values()])
    assert sum(len(lease["tenants"]) for lease in joined["leases"]) == sum(
        len(body["budgets"]["leases"][uid]) for body in shards.values() for uid in body["budgets"].get("leases", {}))

    monkeypatch.setattr("tally_operator.bookkeeping.SHARD_ROOM_BYTES", 24 << 10)  # a bound most shards pass
    status, shards = first_round()
    kept = [len([t for t in body["usage"]["tenants"] if t != "other"]) for body in shards.values()]
    # most shards keep some of their new names (before, a shard past the bound kept none); one whose pods' readings
    # alone fill it keeps none (the readings keep every name a pod reports)
    assert status["usage"]["tenantsFolded"] > 0 and sum(k > 0 for k in kept) > len(kept) // 2, kept
    assert all(body["usage"].get("closed") for body in shards.values() if "other" in body["usage"]["tenants"])
