"""One reconcile pass for one CompletionService: apply the children, read them back, scrape usage, write status.

Everything a pass needs comes in explicitly: the `Context` built once at start-up (settings, API client,
metrics) and the resource's own `ServiceMemory`. Passes run on kopf's event loop; blocking API calls go
through a thread, the scrape is awaited directly. Errors are domain errors here (`KubeError`,
`SpecError`); handlers.py maps the transient ones to kopf's retry.

The status is written here, not through kopf's patch: by compare-and-swap on the resourceVersion the
pass planned against (bookkeeping.py). The pods are scraped after the status they are booked into was
read, and a refused write re-reads the object and scrapes again: so every sample booked is newer than
every reading in the ledger it is booked into, and two passes on one stale body, or a peer that resumes
after another wrote, can never regress `status.usage`, book a stale sample or book a round twice. Only
once the write has landed does the pass count the round on the operator's /metrics, post its Events, and
acknowledge the final counters of drained pods (their runtimes then exit).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import kopf

from tally_operator import constants as c
from tally_operator.activation import Held, read_held
from tally_operator.autoscale import (
    Autoscaling,
    Decision,
    Observation,
    Recommendation,
    clamp,
    decide,
    deletion_cost,
    round_signal,
    scaling_status,
    scaling_verdict,
    with_floor,
    zero_step,
)
from tally_operator.bookkeeping import Observed, Plan, plan
from tally_operator.conditions import Verdict, is_bad
from tally_operator.desired import (
    desired_activator,
    desired_backend_service,
    desired_deployment,
    desired_network_policy,
    desired_pdb,
    desired_service,
    endpoint,
    routes_to_activator,
)
from tally_operator.desired_pool import (
    desired_inference_pool,
    desired_picker,
    picker_name,
    pool_routes_to_activator,
)
from tally_operator.kube import Kube, KubeError
from tally_operator.metrics import OperatorMetrics
from tally_operator.observations import Observations
from tally_operator.pods import is_ready
from tally_operator.policy import check_policy
from tally_operator.samples import MetricsParseError, PodSample, parse_sample
from tally_operator.scrape import Call, post_all, scrape
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer
from tally_operator.spec import Spec, SpecError, check_name, parse_spec
from tally_operator.status import (
    invalid_verdicts,
    observed_fields,
    unschedulable_message,
    workload_verdicts,
)
from tally_operator.usage import (
    MAX_LEDGER_TENANTS,
    Round,
    controller_uid,
    counted_uids,
    ledger_from_status,
    owned_pods,
    pod_url,
    scrape_targets,
)
from tally_runtime import contract
from tally_runtime.contract import BUDGETS_PATH, FINAL_READ_PATH, FINAL_READ_SIGNATURE_HEADER

log = logging.getLogger("tally_operator")
MAX_WRITES = 5  # compare-and-swap attempts per pass before kopf retries the pass
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


Post = Callable[[Any, str, str, str], None]  # (body, type, reason, message): an Event on the resource


def kopf_event(body: Any, kind: str, reason: str, message: str) -> None:
    kopf.event(body, type=kind, reason=reason[:128], message=message[:1024])


@dataclass
class Context:
    """What every pass shares, built once when the operator starts."""

    settings: OperatorSettings
    kube: Kube
    metrics: OperatorMetrics
    signer: Signer
    post_event: Post = kopf_event


@dataclass
class ServiceMemory:
    """What this process remembers about one CompletionService between passes (never the ledger itself:
    that is read from the status every time)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one pass at a time per resource
    scraped_at: float = -1e9  # monotonic time of the last scrape round
    observations: Observations = field(default_factory=Observations)
    apply_error: SpecError | None = None  # the API server's refusal, until a pass applies cleanly
    refused: dict[str, str] = field(default_factory=dict)  # pod uid -> why its last sample was refused
    scaling: Scaling = field(default_factory=lambda: Scaling())


@dataclass
class Scaling:
    """Autoscaling's memory: the signal's recent history and recommendations (never the count: that is the
    Deployment's, read every pass). A restarted operator, a peer taking over, or one that resumes after a
    pause longer than the stable window starts afresh: no scale-down until it has watched for a whole
    scale-down delay."""

    since: float = field(default_factory=time.monotonic)
    history: tuple[Observation, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()
    last_scale_time: str | None = None
    # scale to zero: when traffic was last seen (a restarted operator waits a whole grace), and each pod's
    # request counter as last read (a change is traffic)
    active_at: float = field(default_factory=time.monotonic)
    requests_seen: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Scraped:
    round: Round
    urls: Mapping[str, str]  # pod uid -> the base URL it was reached at
    refused: Mapping[str, str]  # pod uid -> why its /metrics were not trusted this round
    decision: Decision | None = None  # autoscaling's, on this round's signal
    scaling: Scaling | None = None  # the memory to keep once the status holding the decision has landed
    held: Held | None = None  # scale to zero: what the activator holds (None: no activator read)


async def reconcile(ctx: Context, body: kopf.Body, memory: ServiceMemory, apply_children: bool) -> None:
    """One pass. Passes of the same resource (timers, events) run one at a time in this process; across
    processes the status write's compare-and-swap keeps them apart."""
    async with memory.lock:
        await _reconcile(ctx, body, memory, apply_children)


async def _reconcile(ctx: Context, body: kopf.Body, memory: ServiceMemory, apply_children: bool) -> None:
    obj = {"metadata": dict(body.meta), "spec": dict(body.spec), "status": dict(body.get("status") or {})}
    meta = {"name": body.meta["name"], "namespace": body.meta["namespace"], "uid": body.meta["uid"]}
    generation = int(body.meta.get("generation") or 0)
    fields: dict[str, Any] = {"endpoint": endpoint(meta, ctx.settings)}
    if obj["status"].get("usage"):  # a restarted operator or a new leader exports the ledger from its first pass
        ctx.metrics.ledgers.keep(meta["namespace"], meta["name"], ledger_from_status(obj["status"]["usage"]),
                                 created_at(body.meta))
    try:
        spec = parse_spec(body.spec)
        check_policy(spec, ctx.settings)
        check_name(meta["name"], spec)
    except SpecError as error:
        await commit(ctx, body, memory, obj, fixed(Observed(generation, invalid_verdicts(error), fields)))
        return
    # A pass that sees a generation the status has not observed applies it first: observedGeneration never
    # claims a spec whose children were not written (a status timer can run before the update handler).
    apply_children = apply_children or generation != int(obj["status"].get("observedGeneration") or 0)
    activated: Held | None = None
    scaling = spec.autoscaling
    if scaling is not None:  # the operator owns the count: the Deployment's (spec.replicas is not it)
        spec = replace(spec, replicas=await decided_replicas(ctx, meta, scaling))
        if scaling.scales_to_zero and spec.replicas == 0:  # a held request starts a pod at once
            held = await held_now(ctx, meta)
            if held.requests:
                spec, activated, apply_children = replace(spec, replicas=1), held, True
    elif memory.scaling.history or memory.scaling.recommendations:
        memory.scaling = Scaling()  # switched off: switched on again, it starts afresh
    try:
        if apply_children:
            await asyncio.to_thread(apply_all, ctx, meta, spec, bool(obj["status"].get("routing")))
            memory.apply_error = None
        deployment, pods = await asyncio.to_thread(read_children, ctx, meta)
    except KubeError as error:
        if error.transient:
            raise
        memory.apply_error = rejected(error)
        deployment, pods = None, []
    except SpecError as error:  # a child's name is taken by someone else's object
        memory.apply_error = error
        deployment, pods = None, []
    if memory.apply_error is not None:  # until a pass applies cleanly, the rejection is the news
        observed = Observed(generation, invalid_verdicts(memory.apply_error), fields)
        await commit(ctx, body, memory, obj, fixed(observed))
        return
    if activated is not None:
        memory.scaling = replace(memory.scaling, active_at=time.monotonic(), last_scale_time=now())
        log.info("Scaled %s/%s from 0 to 1 pod: %d request(s) held", meta["namespace"], meta["name"],
                 activated.requests)
        ctx.post_event(body, "Normal", "ScaledUp", f"0 -> 1 pod (Activated): {activated.requests} request(s) held "
                                                   "by the activator")
    if spec.autoscaling is not None and spec.autoscaling.scales_to_zero:
        await asyncio.to_thread(route, ctx, body, meta, spec,
                                to_activator=spec.replicas == 0 or not serving_uids(pods))
    fields.update(observed_fields(meta["name"], deployment, fields["endpoint"]))
    fields["desiredReplicas"] = spec.replicas  # with autoscaling, the count it decided (read from the Deployment)
    ctx.metrics.workload(meta["namespace"], meta["name"], spec.replicas, fields["readyReplicas"])
    verdicts = workload_verdicts(spec, deployment, pods)
    if spec.pool is not None:
        fields["routing"], routed = await asyncio.to_thread(pool_status, ctx, meta, spec)
        verdicts.append(routed)
    # Without our Deployment (deleted with --cascade=orphan, say) its pods are not gone: they are re-adopted
    # when it is back, so the ledger waits rather than count them lost and then book them whole again
    due = deployment is not None and scrape_due(memory, spec)

    async def observe(current: Mapping[str, Any]) -> tuple[Observed, Scraped | None]:
        scraped = await scrape_round(ctx, meta, pods, current) if due else None
        more_fields, more_verdicts = dict(fields), list(verdicts)
        if scraped is not None and spec.autoscaling is not None:
            if spec.autoscaling.scales_to_zero:
                scraped = replace(scraped, held=await held_now(ctx, meta))
            scraped = autoscale(spec.autoscaling, spec.replicas, pods, scraped, memory.scaling)
            assert scraped.decision is not None and scraped.scaling is not None
            more_fields["autoscaling"] = scaling_status(spec.autoscaling, scraped.decision, spec.replicas,
                                                        sum(map(is_ready, pods)), scraped.scaling.last_scale_time)
            if scraped.held is not None:
                more_fields["autoscaling"] |= scraped.held.status(time.monotonic() - scraped.scaling.active_at)
            more_verdicts.append(scaling_verdict(scraped.decision))
        return Observed(generation, more_verdicts, more_fields, scraped.round if scraped else None,
                        spec.max_mismatch_ratio, spec.budgets, frozenset(serving_uids(pods)),
                        keep=kept_status(spec)), scraped

    landed_round = await commit(ctx, body, memory, obj, observe)
    if landed_round is not None and landed_round.decision is not None:
        await rescale(ctx, body, meta, spec, memory, landed_round, pods)


def kept_status(spec: Spec) -> frozenset[str]:
    """What a pass keeps of the persisted status when it does not write it anew: the ledger always, and what
    the features that are on wrote (a scrape round writes autoscaling's; another pass keeps it). The status of a
    feature switched off goes."""
    return frozenset({"usage", *(["budgets"] if spec.budgets is not None else []),
                      *(["autoscaling"] if spec.autoscaling is not None else []),
                      *(["routing"] if spec.pool is not None else [])})


async def decided_replicas(ctx: Context, meta: Mapping[str, str], config: Autoscaling) -> int:
    """The count to continue from: the Deployment's, read every pass, never a memory of it (a peer may have
    scaled since this process last decided, or autoscaling was off and spec.replicas applied meanwhile)."""
    deployment = await asyncio.to_thread(ctx.kube.get, "apps/v1", "Deployment", meta["name"], meta["namespace"])
    ours = deployment is not None and controller_uid(deployment) == meta["uid"]
    running = int(((deployment or {}).get("spec") or {}).get("replicas") or 0) if ours else 0
    return clamp(running or config.min_replicas, config)  # bounds lowered or raised in the spec apply at once


async def held_now(ctx: Context, meta: Mapping[str, str], wait: float = 0.0) -> Held:
    return await read_held(ctx.kube, meta, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout, wait)


def serving_uids(pods: list[dict[str, Any]]) -> list[str]:
    """The pods a decision is about: ready and not terminating."""
    return [p["metadata"]["uid"] for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]


def autoscale(config: Autoscaling, current: int, pods: list[dict[str, Any]], scraped: Scraped,
              scaling: Scaling) -> Scraped:
    """This round's decision, and the memory it leaves (kept only once the status holding it landed). A pod
    not read counts as at target; a round that read none adds nothing to the history."""
    at = time.monotonic()
    if scaling.history and at - scaling.history[-1].at > config.stable_window_seconds:
        scaling = Scaling(since=at, last_scale_time=scaling.last_scale_time,  # paused or blind that long: afresh
                          active_at=max(scaling.active_at, at - config.stable_window_seconds))
    serving = serving_uids(pods)
    loads = [scraped.round.samples[uid].load for uid in serving if uid in scraped.round.samples]
    signal = round_signal(config.metric, config.target, loads, len(serving) - len(loads))
    observed = (Observation(at, signal),) if signal is not None else ()
    history = tuple(o for o in (*scaling.history, *observed) if o.at > at - config.stable_window_seconds)
    if current:
        decision = decide(with_floor(config), history, scaling.recommendations, current, sum(map(is_ready, pods)),
                          bool(unschedulable_message(pods)), at, scaling.since, read=len(loads))
    else:
        decision = Decision(0, "Idle", "No pod")
    held = scraped.held.requests if scraped.held is not None else 0
    seen = {uid: sample.all_requests for uid, sample in scraped.round.samples.items()}
    if busy(scraped, loads, held, len(serving), scaling.requests_seen):
        scaling = replace(scaling, active_at=at)
    decision = zero_step(config, decision, current, held, at - scaling.active_at)
    made = (decision.recommendation,) if decision.recommendation else ()
    recommendations = tuple(r for r in (*scaling.recommendations, *made)
                            if r.at > at - config.scale_down_delay_seconds)
    after = replace(scaling, history=history, recommendations=recommendations, requests_seen=seen)
    return replace(scraped, decision=decision, scaling=after)


def busy(scraped: Scraped, loads: list[Mapping[str, float]], held: int, serving: int,
         seen: Mapping[str, float]) -> bool:
    """Traffic this round, for scale to zero: anything held, running or queued, a request counted since the
    last round, or a serving pod not read (what cannot be seen is not idle)."""
    if held or len(loads) < serving:
        return True
    if any(load.get(contract.INFLIGHT_GENERATIONS, 0.0) or load.get(contract.QUEUED_REQUESTS, 0.0) for load in loads):
        return True
    return any(sample.all_requests != seen.get(uid, 0.0) for uid, sample in scraped.round.samples.items())


async def rescale(ctx: Context, body: kopf.Body, meta: Mapping[str, str], spec: Spec, memory: ServiceMemory,
                  scraped: Scraped, pods: list[dict[str, Any]]) -> None:
    """Carry out a decision whose status has landed: idle pods first out (deletion cost), then the count."""
    decision, scaling = scraped.decision, scraped.scaling
    assert decision is not None and scaling is not None and spec.autoscaling is not None
    memory.scaling = scaling
    ctx.metrics.scaling(meta["namespace"], meta["name"], spec.replicas, decision.replicas, decision.stable_signal)
    if scraped.held is not None:
        ctx.metrics.activation(meta["namespace"], meta["name"], scraped.held.requests, scraped.held.cold_start_seconds)
    if decision.replicas == spec.replicas:
        return
    if decision.replicas == 0:  # the activator takes new requests before the last pod starts to drain
        await asyncio.to_thread(route, ctx, body, meta, spec, to_activator=True)
    if decision.replicas < spec.replicas:
        for pod in pods:
            uid = pod["metadata"]["uid"]
            sample = scraped.round.samples.get(uid)
            cost = deletion_cost(sample.load if sample else None if uid in scraped.round.failed else {})
            await asyncio.to_thread(ctx.kube.annotate, "v1", "Pod", pod["metadata"]["name"], meta["namespace"],
                                    {DELETION_COST: str(cost)})
    scaled = replace(spec, replicas=decision.replicas)
    await asyncio.to_thread(ctx.kube.apply, desired_deployment(dict(meta), scaled, ctx.settings))
    memory.scaling = replace(scaling, last_scale_time=now())
    up = decision.replicas > spec.replicas
    log.info("Scaled %s/%s from %d to %d pod(s): %s", meta["namespace"], meta["name"], spec.replicas,
             decision.replicas, decision.message)
    ctx.post_event(body, "Normal", "ScaledUp" if up else "ScaledDown",
                   f"{spec.replicas} -> {decision.replicas} pod(s) ({decision.reason}): {decision.message}")


Observe = Callable[[Mapping[str, Any]], Awaitable[tuple[Observed, "Scraped | None"]]]


def fixed(observed: Observed) -> Observe:
    """Observations that do not depend on the status they are written against (nothing scraped)."""
    async def observe(_: Mapping[str, Any]) -> tuple[Observed, Scraped | None]:
        return observed, None

    return observe


def scrape_due(memory: ServiceMemory, spec: Spec) -> bool:
    if time.monotonic() - memory.scraped_at < spec.scrape_interval_seconds:
        return False
    memory.scraped_at = time.monotonic()
    return True


def read_children(ctx: Context, meta: Mapping[str, str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The Deployment and the pods this CompletionService owns (through its Deployment's ReplicaSets)."""
    selector = f"{c.LABEL_SERVICE}={meta['name']}"
    deployment = ctx.kube.get("apps/v1", "Deployment", meta["name"], meta["namespace"])
    if deployment is not None and controller_uid(deployment) != meta["uid"]:  # someone else's namesake: not ours
        raise SpecError("NameConflict", f"A Deployment named {meta['name']} already exists and is not this "
                                        "CompletionService's; it is left alone: delete or rename it")
    replica_sets = ctx.kube.list("apps/v1", "ReplicaSet", meta["namespace"], selector)
    pods = ctx.kube.pods(meta["namespace"], selector)
    return deployment, [dict(p) for p in owned_pods(pods, replica_sets, deployment, meta["uid"])]


async def scrape_round(ctx: Context, meta: Mapping[str, str], pods: list[dict[str, Any]],
                       obj: Mapping[str, Any]) -> Scraped:
    """Read every pod the ledger counts or should count; each pod's failure is that pod's alone."""
    readings = ledger_from_status((obj.get("status") or {}).get("usage") or {}).readings
    targets = scrape_targets(pods, readings, c.RUNTIME_METRICS_PORT)
    results = await scrape(targets, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
    samples: dict[str, PodSample] = {}
    failed: set[str] = set()
    refused: dict[str, str] = {}
    for uid, result in results.items():
        try:
            if isinstance(result, Exception):
                raise result
            samples[uid] = await parse(result, uid)
        except MetricsParseError as err:
            failed.add(uid)
            refused[uid] = str(err)
        except Exception as err:
            failed.add(uid)
            log.info("Scraping pod %s of %s/%s failed: %r", uid, meta["namespace"], meta["name"], err)
    urls = {uid: url.removesuffix("/metrics") for uid, url in targets.items()}
    return Scraped(Round(samples, frozenset(failed), present=counted_uids(pods)), urls, refused)


PARSE_ON_LOOP_BYTES = 64 << 10  # larger bodies are parsed in a thread: kopf's loop keeps serving meanwhile


async def parse(text: str, uid: str) -> PodSample:
    if len(text) <= PARSE_ON_LOOP_BYTES:
        return parse_sample(text, expected_pod_uid=uid)
    return await asyncio.to_thread(parse_sample, text, uid)


async def commit(ctx: Context, body: kopf.Body, memory: ServiceMemory, obj: Mapping[str, Any],
                 observe: Observe) -> Scraped | None:
    """Observe against `obj`'s status (scraping after it was read), plan, and write by compare-and-swap; a
    refused write reads the object again and observes again. Then what may only follow a landed write.
    Returns the round whose status landed (None: nothing was scraped, or the object is gone)."""
    meta = obj["metadata"]
    for _ in range(MAX_WRITES):
        observed, scraped = await observe(obj)
        planned = plan(obj.get("status") or {}, memory.observations, observed, now())
        if not planned.changed:
            memory.observations = planned.observations
            return scraped
        try:
            await asyncio.to_thread(ctx.kube.replace_status, c.API_VERSION, c.KIND, meta["name"],
                                    meta["namespace"], planned.status, str(meta["resourceVersion"]))
        except KubeError as error:
            if not error.conflict:
                raise
            fresh = await asyncio.to_thread(ctx.kube.get, c.API_VERSION, c.KIND, meta["name"], meta["namespace"])
            if fresh is None or fresh["metadata"]["uid"] != meta["uid"]:
                return None  # deleted (or deleted and created again) meanwhile: nothing of ours to write
            obj, meta = fresh, fresh["metadata"]
            continue
        await landed(ctx, body, memory, planned, scraped)
        return scraped
    raise KubeError(409, f"the status changed under {MAX_WRITES} writes in a row")


async def landed(ctx: Context, body: kopf.Body, memory: ServiceMemory, planned: Plan, scraped: Scraped | None) -> None:
    memory.observations = planned.observations
    meta = body.meta
    post = ctx.post_event
    for condition in planned.transitions:
        post(body, "Warning" if is_bad(condition) else "Normal", f"{condition['type']}{condition['status']}",
             f"{condition['reason']}: {condition['message']}")
    if scraped is None or planned.booking is None:
        return
    for uid, reason in scraped.refused.items():  # once per pod and reason, not every round
        if memory.refused.get(uid) != reason:
            log.warning("Refusing the metrics of pod %s of %s/%s: %s", uid, meta["namespace"], meta["name"], reason)
            post(body, "Warning", "MetricsRefused", f"The /metrics of pod {uid} were not counted: {reason}")
    memory.refused = dict(scraped.refused)
    booking = planned.booking
    if booking.lost:
        post(body, "Warning", "UsageUnaccounted",
             f"{booking.lost} pod(s) went away or restarted their counters before their last counters were read: "
             "what they served since the scrape before is not in the totals")
    ctx.metrics.record(meta["namespace"], meta["name"], booking.ledger,
                       planned.verdict.status if planned.verdict else "Unknown", len(scraped.round.samples),
                       len(scraped.round.failed), created_at(meta))
    if booking.folded:
        post(body, "Warning", "TenantsFolded", f"{booking.folded} tenant(s) beyond the ledger's "
                                               f"{MAX_LEDGER_TENANTS} were booked to tenant 'other' (the totals "
                                               "are unaffected)")
    if planned.budgets is not None:
        for tenant, mark in planned.budgets.crossed:
            post(body, "Warning" if mark >= 1 else "Normal", "BudgetExhausted" if mark >= 1 else "BudgetWarning",
                 f"Tenant {tenant} has spent {mark:.0%} of its budget for {planned.budgets.state.period}")
        refusals: dict[str, float] = {}
        for sample in scraped.round.samples.values():
            for tenant, refused in sample.refusals.items():
                refusals[tenant] = refusals.get(tenant, 0.0) + refused
        ctx.metrics.budgets(meta["namespace"], meta["name"], planned.budgets.tenants, refusals)
        await send_leases(ctx, scraped, planned.budgets.messages)
    await acknowledge_final(ctx, scraped)


async def send_leases(ctx: Context, scraped: Scraped, messages: Mapping[str, Mapping[str, Any]]) -> None:
    """Tell each serving pod its leases (written into the status first: a restarted operator knows them)."""
    calls = {uid: signed(ctx.signer, scraped.urls[uid] + BUDGETS_PATH, message)
             for uid, message in messages.items() if uid in scraped.urls}
    if calls:
        results = await post_all(calls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
        for uid, result in results.items():
            if result != 200:
                log.info("The leases for pod %s were not taken: %r", uid, result)


async def acknowledge_final(ctx: Context, scraped: Scraped) -> None:
    """Tell each drained pod that its final counters are booked: only that lets its runtime exit."""
    calls = {uid: signed(ctx.signer, scraped.urls[uid] + FINAL_READ_PATH, {**sample.acknowledgement(), "podUid": uid})
             for uid, sample in scraped.round.samples.items() if sample.final and uid in scraped.urls}
    if calls:
        results = await post_all(calls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
        for uid, result in results.items():
            if result != 200:
                log.info("The final-read acknowledgement to pod %s was not taken: %r", uid, result)


def signed(signer: Signer, url: str, body: Mapping[str, Any]) -> Call:
    """A final-read call, signed over its exact bytes (tally_runtime/handoff.py)."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return url, raw, {FINAL_READ_SIGNATURE_HEADER: signer.sign(raw)}


async def release_pods(ctx: Context, meta: Mapping[str, str]) -> int:
    """The CompletionService is being deleted, and its ledger with it: its pods are made to drain now (its
    Deployment deleted, rather than after the CompletionService is gone) and each draining one is let exit
    without waiting for a final read nobody will book. A release is signed and names its pod, the pod's counters'
    epoch and the nonce of the drain it ends (read from the pod just before): it ends that drain and no later
    one, so a release sent (or read off the plaintext metrics port) once can never let an adopted pod skip its
    final read afterwards. Returns how many pods still run and were not released (not draining yet)."""
    namespace, name = meta["namespace"], meta["name"]
    deployment = await asyncio.to_thread(ctx.kube.get, "apps/v1", "Deployment", name, namespace)
    if deployment is not None and controller_uid(deployment) == meta["uid"] and \
            not deployment["metadata"].get("deletionTimestamp"):
        await asyncio.to_thread(ctx.kube.delete, "apps/v1", "Deployment", name, namespace,
                                uid=deployment["metadata"]["uid"])
    pods = [pod for pod in await asyncio.to_thread(ctx.kube.pods, namespace, f"{c.LABEL_SERVICE}={name}")
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    urls = {str(pod["metadata"]["uid"]): pod_url(str(pod["status"]["podIP"]), c.RUNTIME_METRICS_PORT, FINAL_READ_PATH)
            for pod in pods if pod["metadata"].get("uid") and (pod.get("status") or {}).get("podIP")}
    challenges = await scrape(urls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout, MAX_CHALLENGE_BYTES)
    calls = {}
    for uid, answer in challenges.items():
        challenge = drain_challenge(answer, uid)
        if challenge is not None:  # a pod not draining yet gets its release on a later try
            calls[uid] = signed(ctx.signer, urls[uid], {"podUid": uid, "release": True, **challenge})
    released = await post_all(calls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout) if calls else {}
    done = sum(1 for result in released.values() if result == 200)
    if done:
        log.info("Released %d draining pod(s) of deleted %s/%s from their final read", done, namespace, name)
    return sum(1 for pod in pods if pod["metadata"].get("uid") and released.get(pod["metadata"]["uid"]) != 200)


MAX_CHALLENGE_BYTES = 4096


def drain_challenge(answer: str | Exception, uid: str) -> dict[str, Any] | None:
    """A draining pod's challenge (its epoch and nonce) from its answer; None for anything else."""
    if isinstance(answer, Exception):
        return None
    try:
        parsed = json.loads(answer)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("podUid") not in (uid, ""):
        return None
    epoch, nonce = parsed.get("epoch"), parsed.get("nonce")
    if not isinstance(epoch, int | float) or isinstance(epoch, bool) or not isinstance(nonce, str) or \
            not 0 < len(nonce) <= 64:
        return None
    return {"epoch": epoch, "nonce": nonce}


def rejected(error: KubeError) -> SpecError:
    """A non-transient API refusal: our RBAC (403) or a child the server finds invalid (400/422)."""
    reason = "Forbidden" if error.status == 403 else "InvalidChild"
    return SpecError(reason, f"The API server refused a child object: {error.message}")


def apply_all(ctx: Context, meta: dict[str, str], spec: Spec, was_routed: bool = False) -> None:
    """Apply every child; a child this service does not need is deleted. Only objects this CompletionService
    controls are ever written or deleted: a same-named object of someone else's is left alone, and the
    pass stops with `NameConflict` (the status and an Event say so)."""
    name = meta["name"]
    zero = spec.autoscaling is not None and spec.autoscaling.scales_to_zero
    children: list[tuple[str, str, str, dict[str, Any] | None]] = [
        ("apps/v1", "Deployment", name, desired_deployment(meta, spec, ctx.settings)),
        ("v1", "Service", name, None),  # below: where it points is decided by the pods' readiness (route)
        ("policy/v1", "PodDisruptionBudget", name, desired_pdb(meta, spec)),
        ("networking.k8s.io/v1", "NetworkPolicy", name, desired_network_policy(meta, ctx.settings)),
        ("apps/v1", "Deployment", name + c.ACTIVATOR_SUFFIX, desired_activator(meta, spec, ctx.settings)),
        ("v1", "Service", name + c.BACKEND_SUFFIX, desired_backend_service(meta, spec)),
    ]
    to_activator = False
    for api_version, kind, child, desired in children:
        if desired is None and kind == "NetworkPolicy" and not ctx.settings.network_policy:
            continue  # never managed here: nothing to look for (and no RBAC to look with)
        if kind == "Service" and child == name:
            to_activator = zero and routes_to_activator(ctx.kube.get(api_version, kind, child, meta["namespace"]))
            desired = desired_service(meta, to_activator=to_activator)
        apply_child(ctx, meta, api_version, kind, child, desired)
    if spec.pool is not None or was_routed:
        apply_pool(ctx, meta, spec, to_activator)  # the pool points where the Service does


def apply_child(ctx: Context, meta: Mapping[str, str], api_version: str, kind: str, child: str,
                desired: dict[str, Any] | None) -> None:
    """Apply one child, or delete it when not wanted; never one this CompletionService does not control."""
    existing = ctx.kube.get(api_version, kind, child, meta["namespace"])
    if existing is not None and controller_uid(existing) != meta["uid"]:
        raise SpecError("NameConflict", f"A {kind} named {child} already exists and is not this "
                                        f"CompletionService's; it is left alone: delete or rename it")
    if desired is not None:
        ctx.kube.apply(desired)
    elif existing is not None:
        ctx.kube.delete(api_version, kind, child, meta["namespace"], uid=existing["metadata"]["uid"])


PICKER_KINDS = (("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("apps/v1", "Deployment"),
                ("networking.k8s.io/v1", "NetworkPolicy"), ("v1", "Service"))


def apply_pool(ctx: Context, meta: Mapping[str, str], spec: Spec, to_activator: bool = False) -> None:
    """The InferencePool and the picker the operator runs for it, only where the pool's CRD is installed
    (pool_status says so otherwise); both deleted once the service is no longer routed or names its own
    picker."""
    served = ctx.kube.has(c.POOL_API_VERSION, c.POOL_KIND)
    if served:
        apply_child(ctx, meta, c.POOL_API_VERSION, c.POOL_KIND, meta["name"],
                    desired_inference_pool(meta, spec, to_activator))
    # A picker without its pool's kind would only fail: it waits for the CRD as the pool does
    wanted = {(o["apiVersion"], o["kind"]): o for o in desired_picker(meta, spec, ctx.settings)} if served else {}
    for api_version, kind in PICKER_KINDS:
        if kind == "NetworkPolicy" and not ctx.settings.network_policy:
            continue  # never managed here: nothing to look for (and no RBAC to look with)
        apply_child(ctx, meta, api_version, kind, meta["name"] + c.PICKER_SUFFIX, wanted.get((api_version, kind)))


def pool_status(ctx: Context, meta: Mapping[str, str], spec: Spec) -> tuple[dict[str, Any], Verdict]:
    """status.routing and the InferencePoolReady condition of a routed service."""
    assert spec.pool is not None
    picker = picker_name(meta, spec)
    fields: dict[str, Any] = {"inferencePool": meta["name"], "endpointPicker": picker, "pickerReady": False}
    if not ctx.kube.has(c.POOL_API_VERSION, c.POOL_KIND):
        return fields, Verdict(c.INFERENCE_POOL_READY, "False", "CRDNotInstalled",
                               f"The InferencePool CRD ({c.POOL_API_VERSION}) is not installed: install the Gateway "
                               "API Inference Extension's CRDs. The Service serves meanwhile")
    if spec.pool.picker:
        found = ctx.kube.get("v1", "Service", picker, meta["namespace"]) is not None
        fields["pickerReady"] = found
        return fields, Verdict(c.INFERENCE_POOL_READY, "True" if found else "False",
                               "PickerNamed" if found else "PickerNotFound",
                               f"InferencePool {meta['name']} points at the endpoint picker Service {picker}"
                               + ("" if found else ", which does not exist"))
    deployment = ctx.kube.get("apps/v1", "Deployment", picker, meta["namespace"])
    ready = bool(deployment and controller_uid(deployment) == meta["uid"]
                 and int((deployment.get("status") or {}).get("readyReplicas") or 0) > 0)
    fields["pickerReady"] = ready
    if ready:
        return fields, Verdict(c.INFERENCE_POOL_READY, "True", "AsExpected",
                               f"InferencePool {meta['name']} and its endpoint picker {picker} are ready")
    return fields, Verdict(c.INFERENCE_POOL_READY, "False", "PickerNotReady",
                           f"The endpoint picker {picker} has no ready pod ({ctx.settings.picker_image})")


def route(ctx: Context, body: Any, meta: Mapping[str, str], spec: Spec, to_activator: bool) -> None:
    """Point a service that scales to zero at its activator (no ready pod) or back at its pods: its Service
    and, when routed through one, its InferencePool (each only if it is ours and points elsewhere)."""
    switched = []
    service = ctx.kube.get("v1", "Service", meta["name"], meta["namespace"])
    if service is not None and controller_uid(service) == meta["uid"] and \
            routes_to_activator(service) != to_activator:
        ctx.kube.apply(desired_service(dict(meta), to_activator=to_activator))
        switched.append("Service")
    desired_pool = desired_inference_pool(meta, spec, to_activator)
    if desired_pool is not None and ctx.kube.has(c.POOL_API_VERSION, c.POOL_KIND):
        pool = ctx.kube.get(c.POOL_API_VERSION, c.POOL_KIND, meta["name"], meta["namespace"])
        if pool is not None and controller_uid(pool) == meta["uid"] and \
                pool_routes_to_activator(pool) != to_activator:
            ctx.kube.apply(desired_pool)
            switched.append("InferencePool")
    if not switched:
        return
    where = "its activator (no ready pod)" if to_activator else "its pods"
    what = f"The {' and the '.join(switched)} now point{'s' if len(switched) == 1 else ''} at {where}"
    log.info("%s/%s: %s", meta["namespace"], meta["name"], what)
    ctx.post_event(body, "Normal", "RoutedToActivator" if to_activator else "RoutedToPods", what)


def created_at(meta: Mapping[str, Any]) -> float | None:
    """The object's creationTimestamp in unix seconds (None when it is missing or malformed)."""
    try:
        return datetime.datetime.strptime(str(meta["creationTimestamp"]), "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.UTC).timestamp()
    except (KeyError, ValueError):
        return None


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
