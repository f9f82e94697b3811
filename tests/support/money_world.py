"""The world the money path's simulation drives (tests/unit/operator/test_money_simulation.py): one
CompletionService in an API server in memory (memory_api.py), its pods (tenant_pods.py) and what they served, the
operator's real pass (`books.commit`) with its memory (lost when it crashes), and the invariants of the books
checked as expressions against what the pods served."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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

    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)

    @property
    def ctx(self) -> Context:
        return Context(OperatorSettings(), self.api, self.metrics, SIGNER, post_event=self.posted)  # type: ignore[arg-type]

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
