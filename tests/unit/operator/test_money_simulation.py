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
from dataclasses import dataclass, field
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from memory_api import Crash, MemoryApi
from tenant_pods import Pod

from tally_operator import constants as c
from tally_operator.bookkeeping import Observed
from tally_operator.books import commit
from tally_operator.context import Context, Scraped, ServiceMemory
from tally_operator.kube import KubeError
from tally_operator.metrics import OperatorMetrics
from tally_operator.samples import Counters
from tally_operator.settings import OperatorSettings
from tally_operator.shard_store import read_shards
from tally_operator.shards import merged, totals_ledger
from tally_operator.signing import Signer
from tally_operator.usage import Ledger, Round, ledger_from_status
from tally_runtime.contract import OTHER_TENANT

NAMESPACE = "team-a"
SIGNER = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))  # a fixed key: a seed replays exactly


def hostile_names(rng: random.Random, n: int) -> list[str]:
    """Tenant names as long as a runtime allows (128 characters), in CJK, emoji and Latin with accents."""
    alphabets = ["漢字仮名交じり文", "🙂🚀💸🧾", "ÀÉÎÕÜçñß", "abcdefghij"]
    names = set()
    while len(names) < n:
        letters = rng.choice(alphabets)
        names.add(f"{len(names)}-" + "".join(rng.choice(letters) for _ in range(rng.randint(100, 124))))
    return sorted(names)


class Posted:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, body: Any, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


@dataclass
class Body:
    """What kopf hands a pass: the object's metadata as this process last saw it."""

    meta: dict[str, Any]


@dataclass
class World:
    """One service, its pods, what they served, and the operator (its memory dies with it)."""

    rng: random.Random
    api: MemoryApi
    meta: dict[str, Any]
    names: list[str]
    pods: dict[str, Pod] = field(default_factory=dict)
    served: dict[str, Counters] = field(default_factory=dict)
    memory: ServiceMemory = field(default_factory=ServiceMemory)
    posted: Posted = field(default_factory=Posted)
    killed_unread: int = 0
    next_pod: int = 0
    draining: set[str] = field(default_factory=set)
    last_round: Round = field(default_factory=lambda: Round({}))  # the last one a pass observed

    @property
    def ctx(self) -> Context:
        return Context(OperatorSettings(), self.api, OperatorMetrics(), SIGNER, post_event=self.posted)  # type: ignore[arg-type]

    def add_pod(self) -> None:
        self.next_pod += 1
        uid = f"pod-{self.next_pod}"
        self.pods[uid] = Pod(uid, epoch=float(self.next_pod))

    def serve(self, requests: int) -> None:
        live = [p for uid, p in self.pods.items() if uid not in self.draining]
        for _ in range(requests if live else 0):
            pod, tenant = self.rng.choice(live), self.rng.choice(self.names)
            got = pod.serve(tenant, self.rng.randint(1, 400), self.rng.randint(1, 200), self.rng.randint(0, 5))
            self.served[tenant] = self.served.get(tenant, Counters()).plus(got)

    def round(self, failing: float = 0.0) -> Round:
        samples, failed = {}, set()
        for uid, pod in self.pods.items():
            if self.rng.random() < failing:
                failed.add(uid)
            else:
                samples[uid] = pod.sample(final=uid in self.draining)
        self.last_round = Round(samples, frozenset(failed), frozenset(self.pods))
        return self.last_round

    async def run_pass(self, failing: float = 0.0) -> bool:
        """One pass; True when it landed. A crash takes the operator's memory with it."""
        async def observe(_: Any) -> tuple[Observed, Scraped]:
            round_ = self.round(failing)
            return Observed(1, [], {}, round_, keep=frozenset({"usage"})), Scraped(round_, {}, {})

        self.memory.scrape_now = True
        obj = self.api.get(c.API_VERSION, c.KIND, self.meta["name"], NAMESPACE)
        assert obj is not None
        try:
            landed = await commit(self.ctx, Body(obj["metadata"]), self.memory, obj, observe)  # type: ignore[arg-type]
        except Crash:
            self.memory = ServiceMemory()
            return False
        except KubeError as error:  # kopf retries the pass
            assert error.transient, error
            return False
        return landed is not None

    # -- what the books say ------------------------------------------------------------------------------------

    def books(self) -> tuple[Ledger, Ledger]:
        """(the status's totals, the whole ledger: totals with every shard's tenants)."""
        obj = self.api.get(c.API_VERSION, c.KIND, self.meta["name"], NAMESPACE)
        assert obj is not None
        usage = (obj.get("status") or {}).get("usage") or {}
        totals = totals_ledger(ledger_from_status(usage))
        shards = {i: s.ledger for i, s in read_shards(self.api, obj["metadata"]).items()}  # type: ignore[arg-type]
        return totals, merged(totals, shards)

    def check(self, landed: bool) -> None:
        totals, whole = self.books()
        served_total = Counters()
        for counters in self.served.values():
            served_total = served_total.plus(counters)
        served_total = served_total.tenant_part()
        # never more: no line, and not the totals, above what was served
        assert not totals.totals.tenant_part().below(Counters()) and \
            not served_total.below(totals.totals.tenant_part()), (totals.totals, served_total)
        folded_served = Counters()
        for name, line in whole.tenants.items():
            if name != OTHER_TENANT:
                assert not self.served.get(name, Counters()).tenant_part().below(line.tenant_part()), name
        summed = Counters()
        for line in whole.tenants.values():
            summed = summed.plus(line)
        assert not served_total.below(summed.tenant_part()), (summed, served_total)
        if not landed:
            return
        # the sums: the tenants' lines add up to the totals
        assert summed.tenant_part() == totals.totals.tenant_part(), (summed, totals.totals)
        if self.killed_unread or set(self.pods) != set(totals.readings) or self.last_round.failed or \
                any(totals.readings[uid].counters != pod.sample().counters for uid, pod in self.pods.items()):
            return
        # exact: every pod read in the round that landed (none left for later), none killed unread
        for name, counters in self.served.items():
            line = whole.tenants.get(name)
            if line is None:
                folded_served = folded_served.plus(counters)
            else:
                assert line.tenant_part() == counters.tenant_part(), name
        other = whole.tenants.get(OTHER_TENANT, Counters())
        assert other.tenant_part() == folded_served.tenant_part()
        assert totals.totals.tenant_part() == served_total


def faults(rng: random.Random, rate: float) -> Any:
    def fault(when: str, what: str, obj: dict[str, Any]) -> None:
        roll = rng.random()
        if roll >= rate:
            return
        kind = rng.choice(["conflict", "error", "crash"])
        if kind == "conflict" and when == "before":
            raise KubeError(409, "the object has been modified")
        if kind == "error" and when == "before":
            raise KubeError(500, "etcdserver: leader changed")
        if kind == "crash":
            raise Crash(f"the operator died {when} a {what} write")
    return fault


def new_world(seed: int, tenants: int) -> World:
    rng = random.Random(seed)
    api = MemoryApi()
    service = api.create({"apiVersion": c.API_VERSION, "kind": c.KIND,
                          "metadata": {"name": "chat", "namespace": NAMESPACE, "uid": f"svc-{seed}",
                                       "generation": 1},
                          "spec": {}, "status": {}})
    world = World(rng, api, service["metadata"], hostile_names(rng, tenants))
    for _ in range(rng.randint(1, 4)):
        world.add_pod()
    return world


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
