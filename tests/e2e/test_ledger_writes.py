"""The ledger's compare-and-swap against the real API server: two passes on one stale body, a peer that
pauses for another and resumes after it left, two operators racing on one resource.

Each pass is the operator's own `commit` (observe, plan, write by compare-and-swap, re-read and observe
again when refused) with its own `ServiceMemory` and /metrics, as one operator process would run it; what
a pass observes is a pod's counters, which the test advances as clients would. The chart's operator is
scaled to none meanwhile, so these passes are the only writers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import json as jsonlib
import uuid
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from kube_harness import ROOT, Kubectl, eventually
from operator_harness import NAMESPACE, RELEASE
from usage_harness import status

from tally_operator.bookkeeping import Observed
from tally_operator.books import Observe, commit
from tally_operator.context import Context, Scraped, ServiceMemory
from tally_operator.kube import Kube
from tally_operator.metrics import OperatorMetrics
from tally_operator.reconcile import reconcile
from tally_operator.report import main as tally_usage
from tally_operator.samples import Counters, PodSample
from tally_operator.settings import OperatorSettings
from tally_operator.shards import SHARDS
from tally_operator.signing import Signer
from tally_operator.usage import Round

pytestmark = pytest.mark.e2e
SIGNER = Signer.load("")  # the chart's signing key, which every operator of a release holds


class Pod:
    """A runtime's counters as its clients move them."""

    def __init__(self, tenants: tuple[str, ...] = ("alpha",)) -> None:
        self.uid = str(uuid.uuid4())
        self.tenants = dict.fromkeys(tenants, 0.0)

    def serve(self, tokens: float, tenant: str = "alpha") -> None:
        self.tenants[tenant] += tokens

    @property
    def completion(self) -> float:
        return sum(self.tenants.values())

    def sample(self) -> PodSample:
        return PodSample(Counters(requests=self.completion, completion_tokens=self.completion), "incremental",
                         started=1.0, pod_uid=self.uid,
                         tenants={t: Counters(requests=v, completion_tokens=v) for t, v in self.tenants.items()})


def observing(pods: list[Pod], generation: int = 1, before: Any = None) -> Observe:
    """A pass that scrapes `pods` (after reading the status it writes over, as the operator does)."""
    async def observe(_: Any) -> tuple[Observed, Scraped | None]:
        if before is not None:
            before()
        round_ = Round({p.uid: p.sample() for p in pods}, present=frozenset(p.uid for p in pods))
        return Observed(generation, [], {}, round_), Scraped(round_, {}, {})

    return observe


def nothing_scraped(generation: int = 1) -> Observe:
    async def observe(_: Any) -> tuple[Observed, Scraped | None]:
        return Observed(generation, [], {"endpoint": "http://x"}), None

    return observe


class Operator:
    """One operator process: its settings, API client, /metrics and memory of the service."""

    def __init__(self, kubeconfig: str) -> None:
        self.events: list[tuple[str, str]] = []
        self.ctx = Context(OperatorSettings(), Kube(kubeconfig), OperatorMetrics(), SIGNER,
                           post_event=lambda _b, kind, reason, _m: self.events.append((kind, reason)))
        self.memory = ServiceMemory()

    async def pass_on(self, body: dict[str, Any], observe: Observe) -> None:
        await commit(self.ctx, kopf.Body(copy.deepcopy(body)), self.memory, copy.deepcopy(body), observe)

    def booked(self, field: str, tenant: str | None = None) -> float:
        name = f"tally_service_tenant_{field}_total" if tenant else f"tally_service_{field}_total"
        total = 0.0
        for family in self.ctx.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and (tenant is None or sample.labels.get("tenant") == tenant):
                    total += sample.value
        return total


@pytest.fixture
def writers(kubectl: Kubectl, kube_env: dict[str, str]) -> Iterator[str]:
    """The chart's operator scaled to none (if installed) and the CRD present; yields the kubeconfig."""
    for crd in ("completionservices", "usageshards"):
        kubectl("apply", "--server-side", "--force-conflicts", "-f",
                str(ROOT / "crds" / f"serving.tally.dev_{crd}.yaml"))
    system = kubectl.in_namespace(NAMESPACE)
    replicas = system("get", "deployment", RELEASE, "-o", "jsonpath={.spec.replicas}", check=False).strip()
    if replicas:
        system("scale", "deployment", RELEASE, "--replicas=0")
        eventually(lambda: not system("get", "pods", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name"),
                   120, what="the chart's operator stopped")
    yield kube_env["KUBECONFIG"]
    if replicas:
        system("scale", "deployment", RELEASE, f"--replicas={replicas}")
        system("rollout", "status", f"deployment/{RELEASE}", "--timeout=180s")


def create(kube: Kubectl) -> dict[str, Any]:
    kube.apply({"apiVersion": "serving.tally.dev/v1alpha1", "kind": "CompletionService",
                "metadata": {"name": "books"}, "spec": {"model": {"name": "m"}, "engine": {"kind": "cpu"},
                                                       "replicas": 0}})
    return dict(kube.json("get", "completionservice", "books"))


def usage(kube: Kubectl) -> dict[str, Any]:
    """status.usage, its tenants read from the service's UsageShards (as tally-usage reads them)."""
    return dict(status(kube, "books").get("usage") or {})


def test_two_passes_on_one_stale_body_never_regress_the_ledger(writers: str, kube: Kubectl) -> None:
    stale = create(kube)
    operator, pod = Operator(writers), Pod()
    pod.serve(100)
    asyncio.run(operator.pass_on(stale, observing([pod])))
    assert usage(kube)["completionTokens"] == 100
    # the status timer and an event handler both run on the body from before that write
    asyncio.run(operator.pass_on(stale, nothing_scraped()))
    assert usage(kube)["completionTokens"] == 100 and usage(kube)["sequence"] == 1
    pod.serve(50)
    asyncio.run(operator.pass_on(stale, observing([pod])))
    assert (usage(kube)["completionTokens"], usage(kube)["sequence"]) == (150, 2)
    assert operator.booked("completion_tokens") == 150


def test_a_peer_that_pauses_and_resumes_continues_from_the_newest_ledger(writers: str, kube: Kubectl) -> None:
    """Operator A books, pauses while B (higher priority) serves; a pod is replaced meanwhile; B leaves and A
    resumes with its old body and memory. Nothing is lost, nothing counted twice, nothing goes backwards."""
    body = create(kube)
    a, b = Operator(writers), Operator(writers)
    first = Pod()
    first.serve(10)
    asyncio.run(a.pass_on(body, observing([first])))
    a_body = dict(kube.json("get", "completionservice", "books"))  # what A last saw before it paused
    seen = [usage(kube)]

    first.serve(240)  # A pauses; B takes over and books
    asyncio.run(b.pass_on(dict(kube.json("get", "completionservice", "books")), observing([first])))
    seen.append(usage(kube))
    second = Pod()  # the pod is replaced while A is paused: B books the new one and the old one's end
    second.serve(8)
    asyncio.run(b.pass_on(dict(kube.json("get", "completionservice", "books")), observing([second])))
    seen.append(usage(kube))

    second.serve(10)  # B is gone; A resumes on what it remembers
    asyncio.run(a.pass_on(a_body, observing([second])))
    seen.append(usage(kube))
    truth = first.completion + second.completion
    assert seen[-1]["completionTokens"] == truth == 268
    totals = [u["completionTokens"] for u in seen]
    assert totals == sorted(totals) and [u["sequence"] for u in seen] == [1, 2, 3, 4]
    assert seen[-1]["tenants"]["alpha"]["completionTokens"] == truth  # the tenant ledger went through B as well
    # Each operator's series are the ledger as it last wrote it: A's, after resuming, are the whole ledger
    assert a.booked("completion_tokens") == a.booked("completion_tokens", tenant="alpha") == truth
    assert b.booked("completion_tokens", tenant="alpha") == seen[2]["tenants"]["alpha"]["completionTokens"]


def test_two_operators_racing_on_one_resource_book_every_token_once(writers: str, kube: Kubectl) -> None:
    body = create(kube)
    a, b = Operator(writers), Operator(writers)
    pod = Pod()

    def traffic() -> None:  # clients keep going while the passes scrape
        pod.serve(7)

    async def race() -> None:
        for _ in range(6):
            await asyncio.gather(a.pass_on(body, observing([pod], before=traffic)),
                                 b.pass_on(body, observing([pod], before=traffic)))

    asyncio.run(race())
    final = usage(kube)
    reading = next(p for p in final["pods"] if p["uid"] == pod.uid)
    assert final["completionTokens"] == reading["completionTokens"] <= pod.completion
    assert final["podsUnaccounted"] == 0 and final["sequence"] == 12
    assert final["tenants"]["alpha"]["completionTokens"] == final["completionTokens"]
    assert max(a.booked("completion_tokens"), b.booked("completion_tokens")) == final["completionTokens"]


def test_a_status_pass_on_a_new_generation_applies_it_before_claiming_it(writers: str, kube: Kubectl) -> None:
    """The status timer can run on a new spec before the update handler: it must not write that generation
    as observed over children still rendered from the old one."""
    create(kube)
    operator = Operator(writers)
    body = dict(kube.json("get", "completionservice", "books"))
    asyncio.run(reconcile(operator.ctx, kopf.Body(body), operator.memory, apply_children=True))
    kube("patch", "completionservice", "books", "--type=merge", "-p", '{"spec":{"engine":{"contextLength":1024}}}')
    body = dict(kube.json("get", "completionservice", "books"))
    asyncio.run(reconcile(operator.ctx, kopf.Body(body), operator.memory, apply_children=False))
    args = kube.json("get", "deployment", "books")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--context-length") + 1] == "1024"
    assert kube.json("get", "completionservice", "books")["status"]["observedGeneration"] == body["metadata"][
        "generation"] == 2


def test_a_status_key_a_pass_does_not_write_is_gone_once_its_feature_is(writers: str, kube: Kubectl) -> None:
    """The status is written whole: a JSON merge patch kept every key it did not name, so the status of a
    feature switched off stayed (and was rewritten every pass), a map's names were never dropped (status.budgets
    grew with every tenant ever asked for, until etcd refused every write and the ledger stopped) and `{}`
    deleted nothing. Read back through the real API server."""
    body = create(kube)
    operator, pod = Operator(writers), Pod()
    pod.serve(5)

    def observing_with(fields: dict[str, Any], keep: frozenset[str] | None) -> Observe:
        async def observe(_: Any) -> tuple[Observed, Scraped | None]:
            round_ = Round({pod.uid: pod.sample()}, present=frozenset([pod.uid]))
            return Observed(1, [], fields, round_, keep=keep), Scraped(round_, {}, {})
        return observe

    asyncio.run(operator.pass_on(body, observing_with(
        {"autoscaling": {"desiredReplicas": 3}, "routing": {"inferencePool": "books"}}, frozenset({"usage"}))))
    written = kube.json("get", "completionservice", "books")["status"]
    assert written["autoscaling"] == {"desiredReplicas": 3} and written["routing"]["inferencePool"] == "books"
    # a pass that keeps autoscaling's status but no longer routes: routing goes, autoscaling and the ledger stay
    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")),
                                 observing_with({}, frozenset({"usage", "autoscaling"}))))
    written = kube.json("get", "completionservice", "books")["status"]
    assert "routing" not in written and written["autoscaling"] == {"desiredReplicas": 3}
    assert written["usage"]["completionTokens"] == 5
    # a pass on an invalid spec cannot tell which features are on: it keeps every key
    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")), observing_with({}, None)))
    assert kube.json("get", "completionservice", "books")["status"]["autoscaling"] == {"desiredReplicas": 3}


def test_a_ledger_still_taking_its_baseline_says_so_after_its_write(writers: str, kube: Kubectl) -> None:
    """After an upgrade from a status without per-pod readings the ledger is a baseline until every counted pod
    has one: that `complete: false` must survive the write (it was read back as complete, and a pod read first
    afterwards was booked whole, counted twice)."""
    create(kube)
    kube("patch", "completionservice", "books", "--subresource=status", "--type=merge", "-p",
         '{"status": {"usage": {"requests": 9, "completionTokens": 90}}}')
    operator, read, unread = Operator(writers), Pod(), Pod()
    read.serve(100)
    unread.serve(40)

    async def one_read_one_failed(_: Any) -> tuple[Observed, Scraped | None]:
        round_ = Round({read.uid: read.sample()}, failed=frozenset([unread.uid]),
                       present=frozenset([read.uid, unread.uid]))
        return Observed(1, [], {}, round_, keep=frozenset({"usage"})), Scraped(round_, {}, {})

    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")), one_read_one_failed))
    assert usage(kube)["complete"] is False and usage(kube)["completionTokens"] == 90  # a baseline, nothing new
    unread.serve(2)
    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")),
                                 observing([read, unread])))
    assert usage(kube)["completionTokens"] == 90 and "complete" not in usage(kube)  # both baselines now: complete
    read.serve(3)
    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")), observing([read, unread])))
    assert usage(kube)["completionTokens"] == 93


@pytest.fixture
def simulated_pods(monkeypatch: pytest.MonkeyPatch) -> list[Pod]:
    """Pods the passes find among the service's children and scrape, with counters the test moves (the real
    Deployment stays at no pod): reconcile's own flow, books written through the real API server."""
    from tally_operator import reconcile as reconcile_module

    pods: list[Pod] = []
    real_read = reconcile_module.read_children

    def read_children(ctx: Any, meta: Any) -> tuple[Any, list[dict[str, Any]]]:
        deployment, found = real_read(ctx, meta)
        return deployment, [*found, *({"metadata": {"uid": p.uid, "name": p.uid, "labels": {}},
                                       "status": {"phase": "Running", "podIP": "198.18.9.9", "conditions": [
                                           {"type": "Ready", "status": "True"}]}} for p in pods)]

    async def scrape_round(_ctx: Any, _meta: Any, _pods: Any, _obj: Any) -> Scraped:
        round_ = Round({p.uid: p.sample() for p in pods}, present=frozenset(p.uid for p in pods))
        return Scraped(round_, {}, {})

    monkeypatch.setattr(reconcile_module, "read_children", read_children)
    monkeypatch.setattr(reconcile_module, "scrape_round", scrape_round)
    return pods


def ready_reason(kube: Kubectl) -> str:
    status = kube.json("get", "completionservice", "books").get("status") or {}
    return str(next((c["reason"] for c in status.get("conditions") or [] if c["type"] == "Ready"), ""))


def test_a_child_someone_else_owns_stops_the_children_but_never_the_books(
        writers: str, kube: Kubectl, simulated_pods: list[Pod]) -> None:
    """A foreign Service named `<name>-pods` (or a 403 on a child) made every pass return before scraping: pods
    kept serving and nothing was booked. Now the conflict is the Ready condition and the books go on."""
    kube.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "books-pods"},
                "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}})
    kube.apply({"apiVersion": "serving.tally.dev/v1alpha1", "kind": "CompletionService", "metadata": {"name": "books"},
                "spec": {"model": {"name": "m"}, "engine": {"kind": "cpu"},
                         "autoscaling": {"minReplicas": 0, "maxReplicas": 1}}})
    operator, pod = Operator(writers), Pod()
    simulated_pods.append(pod)
    pod.serve(30)
    asyncio.run(reconcile(operator.ctx, kopf.Body(kube.json("get", "completionservice", "books")), operator.memory,
                          apply_children=True))
    assert ready_reason(kube) == "NameConflict"
    assert usage(kube)["completionTokens"] == 30
    pod.serve(12)
    operator.memory.scraped_at = -1e9  # the next round is due
    asyncio.run(reconcile(operator.ctx, kopf.Body(kube.json("get", "completionservice", "books")), operator.memory,
                          apply_children=True))
    assert usage(kube)["completionTokens"] == 42 and ready_reason(kube) == "NameConflict"


def test_a_spec_the_operator_refuses_still_has_its_pods_booked(writers: str, kube: Kubectl,
                                                               simulated_pods: list[Pod]) -> None:
    """A spec refused after its pods were made (a policy tightened, an image no longer allowed) left the pods
    serving unbooked. Now they are booked while Ready says why the spec is refused."""
    create(kube)
    operator, pod = Operator(writers), Pod()
    simulated_pods.append(pod)
    asyncio.run(reconcile(operator.ctx, kopf.Body(kube.json("get", "completionservice", "books")), operator.memory,
                          apply_children=True))
    # an image the cluster's admission policy (the chart's, if installed) still lets through but this operator no
    # longer runs: its allow-list (here only its own runtime image) was tightened after the pods were made
    assert "tally-runtime-fakes:later" not in operator.ctx.settings.allowed_images
    kube("patch", "completionservice", "books", "--type=merge", "-p",
         '{"spec":{"engine":{"image":"tally-runtime-fakes:later"}}}')
    pod.serve(25)
    operator.memory.scraped_at = -1e9
    asyncio.run(reconcile(operator.ctx, kopf.Body(kube.json("get", "completionservice", "books")), operator.memory,
                          apply_children=True))
    assert ready_reason(kube) == "ForbiddenImage" and usage(kube)["completionTokens"] == 25


def test_the_budgets_status_round_trip_defers_a_count_changed_mid_month(writers: str, kube: Kubectl) -> None:
    """Budgets planned and written through the real API server: the names in the status are this round's (a merge
    patch kept every one ever asked for); a count changed mid-month waits for the next month."""
    import dataclasses

    from tally_operator.budget import BudgetConfig, TenantBudget

    body = create(kube)
    operator, pod = Operator(writers), Pod(("acme",))
    config = BudgetConfig("total", TenantBudget(monthly_tokens=50), {"acme": TenantBudget(monthly_tokens=1000)})

    def asking(names: frozenset[str], budgets: BudgetConfig = config) -> Observe:  # each asks for 10 tokens
        async def observe(_: Any) -> tuple[Observed, Scraped | None]:
            sample = dataclasses.replace(pod.sample(), wanted=dict.fromkeys(sorted(names), 10))
            round_ = Round({pod.uid: sample}, present=frozenset([pod.uid]))
            return (Observed(1, [], {}, round_, budgets=budgets, serving=frozenset([pod.uid]),
                             keep=frozenset({"usage", "budgets"})), Scraped(round_, {pod.uid: "http://pod"}, {}))
        return observe

    pod.serve(100, "acme")
    asyncio.run(operator.pass_on(body, asking(frozenset(f"made-up-{i}" for i in range(300)))))
    first = status(kube, "books")["budgets"]
    assert len(first["tenants"]) == 301  # acme and the 300 asked for (a default covers them)
    assert first["tenants"]["acme"]["spent"] == 0  # the month is counted from the round the budgets first apply
    pod.serve(100, "acme")
    completion = dataclasses.replace(config, count="completion")
    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")),
                                 asking(frozenset(), completion)))
    third = status(kube, "books")["budgets"]
    assert (third["count"], third["pendingCount"]) == ("total", "completion")
    assert third["tenants"]["acme"]["spent"] == 100


def test_records_a_pod_could_not_deliver_are_told_in_an_event_once_per_increase(writers: str, kube: Kubectl) -> None:
    """A pod whose spool was full (the receiver down) counts the records it dropped: the operator says so on the
    service, once for each increase it reads, never for a count it already told."""
    import dataclasses

    body = create(kube)
    operator, pod = Operator(writers), Pod()

    def losing(count: int) -> Observe:
        async def observe(_: Any) -> tuple[Observed, Scraped | None]:
            pod.serve(1)
            sample = dataclasses.replace(pod.sample(), records_lost=count)
            round_ = Round({pod.uid: sample}, present=frozenset([pod.uid]))
            return Observed(1, [], {}, round_), Scraped(round_, {}, {})
        return observe

    for count in (0, 0, 5, 5, 12):
        asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")), losing(count)))
    assert [reason for _, reason in operator.events].count("UsageRecordsLost") == 2
    assert body["metadata"]["uid"]


def test_ten_thousand_tenants_are_booked_exactly_in_usage_shards_none_over_256_kib(writers: str, kube: Kubectl,
                                                                                  tmp_path: Any) -> None:
    """10,000 tenants with 128-character names, mostly CJK (384 bytes each as stored, 768 escaped), over 20 pods
    (500 each) through the real API server: the status holds no tenant and stays small, every UsageShard is
    under 256 KiB and owned by the service, none folded, each round writes only the shards that changed, and
    `tally-usage` on `kubectl get completionservices,usageshards -o json` gives every tenant exactly what its
    clients were served."""
    body = create(kube)
    operator = Operator(writers)
    letters = "漢字仮名交じり文勘定台帳"
    names = [f"{i:05d}-" + "".join(letters[(i * 7 + j) % len(letters)] for j in range(122)) for i in range(10_000)]
    pods = [Pod(tuple(names[i * 500:(i + 1) * 500])) for i in range(20)]
    served: dict[str, float] = {}
    for round_number in range(2):
        for pod in pods:
            for tenant in pod.tenants:
                tokens = 1 + (int(tenant[:5]) + round_number) % 7
                pod.serve(tokens, tenant)
                served[tenant] = served.get(tenant, 0) + tokens
        asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")), observing(pods)))
    shards = kube.json("get", "usageshards", "-l", f"serving.tally.dev/service-uid={body['metadata']['uid']}")["items"]
    assert len(shards) == SHARDS
    assert max(len(jsonlib.dumps(s, ensure_ascii=False, separators=(",", ":")).encode()) for s in shards) < 256 << 10
    assert all(s["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"] for s in shards)
    obj = kube.json("get", "completionservice", "books")
    assert "tenants" not in obj["status"]["usage"] and obj["status"]["usage"]["tenantCount"] == 10_000
    assert obj["status"]["usage"]["tenantsFolded"] == 0
    assert len(jsonlib.dumps(obj)) < 32 << 10
    assert obj["status"]["usage"]["completionTokens"] == sum(served.values())
    # a round in which one tenant was served writes its shard alone
    versions = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in shards}
    pods[0].serve(3, names[0])
    served[names[0]] += 3
    asyncio.run(operator.pass_on(dict(kube.json("get", "completionservice", "books")), observing(pods)))
    after = kube.json("get", "usageshards", "-l", f"serving.tally.dev/service-uid={body['metadata']['uid']}")["items"]
    assert sum(s["metadata"]["resourceVersion"] != versions[s["metadata"]["name"]] for s in after) == 1
    listing = tmp_path / "now.json"
    listing.write_text(kube("get", "completionservices,usageshards", "-o", "json"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tally_usage([str(listing), "--json"]) == 0
    books = {line["tenant"]: line["completionTokens"] for line in map(jsonlib.loads, out.getvalue().splitlines())}
    assert books == served
    assert operator.booked("completion_tokens", tenant=names[0]) == served[names[0]]
