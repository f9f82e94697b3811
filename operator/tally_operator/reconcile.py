"""One reconcile pass for one CompletionService: apply the children, read them back, scrape usage, write status.

Everything a pass needs comes in explicitly: the `Context` built once at start-up (settings, API client,
metrics) and the resource's own `ServiceMemory` (context.py). Passes run on kopf's event loop; blocking API calls
go through a thread, the scrape is awaited directly. Errors are domain errors here (`KubeError`, `SpecError`);
handlers.py maps the transient ones to kopf's retry. The steps live in modules of their own: children.py
(apply and read back), books.py (scrape, book, write the status by compare-and-swap, then what may follow a
landed write), scaling.py (autoscaling's decision and scale), release.py (a deleted service's pods)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import kopf

from tally_operator.activation import Held
from tally_operator.autoscale import (
    scaling_status,
    scaling_verdict,
)
from tally_operator.bookkeeping import Observed
from tally_operator.books import commit, created_at, now, scrape_due, scrape_round
from tally_operator.children import apply_all, pool_status, read_children, rejected, route
from tally_operator.conditions import Verdict
from tally_operator.context import Context, Scaling, Scraped, ServiceMemory
from tally_operator.desired import (
    endpoint,
)
from tally_operator.kube import KubeError
from tally_operator.platform import PlatformBudget, budgets_in_force
from tally_operator.pods import is_ready, leasable_uids
from tally_operator.policy import check_policy
from tally_operator.scaling import autoscale, decided_replicas, held_now, rescale, serving_uids
from tally_operator.shard_store import whole_ledger
from tally_operator.spec import Spec, SpecError, check_name, parse_spec
from tally_operator.status import (
    invalid_verdicts,
    observed_fields,
    workload_verdicts,
)

log = logging.getLogger("tally_operator")
DEFAULT_SCRAPE_SECONDS = 15.0  # usageHealth.scrapeIntervalSeconds' default: a pass on an invalid spec has no other

async def reconcile(ctx: Context, body: kopf.Body, memory: ServiceMemory, apply_children: bool,
                    platform: Sequence[PlatformBudget] = ()) -> None:
    """One pass. Passes of the same resource (timers, events) run one at a time in this process; across
    processes the status write's compare-and-swap keeps them apart. `platform`: the cluster's Budgets."""
    async with memory.lock:
        await _reconcile(ctx, body, memory, apply_children, platform)

def with_budgets(spec: Spec, meta: Mapping[str, str], labels: Mapping[str, str], platform: Sequence[PlatformBudget],
                 pods: int) -> tuple[Spec, Verdict | None]:
    """The spec with the budgets its pods enforce in place of spec.budgets (platform.py), and why."""
    config, verdict = budgets_in_force(spec.budgets, bool(spec.api_keys_secret), meta["namespace"], meta["name"],
                                       meta["uid"], labels, platform, pods, datetime.datetime.now(datetime.UTC))
    return replace(spec, budgets=config), verdict

async def _reconcile(ctx: Context, body: kopf.Body, memory: ServiceMemory, apply_children: bool,
                     platform: Sequence[PlatformBudget]) -> None:
    obj = {"metadata": dict(body.meta), "spec": dict(body.spec), "status": dict(body.get("status") or {})}
    meta = {"name": body.meta["name"], "namespace": body.meta["namespace"], "uid": body.meta["uid"]}
    generation = int(body.meta.get("generation") or 0)
    fields: dict[str, Any] = {"endpoint": endpoint(meta, ctx.settings)}
    if obj["status"].get("usage") and not ctx.metrics.ledgers.has(meta["namespace"], meta["name"]):
        # a restarted operator or a new leader exports the ledger (the status's totals, the shards' tenants) from
        # its first pass
        ctx.metrics.ledgers.keep(meta["namespace"], meta["name"], await asyncio.to_thread(
            whole_ledger, ctx.kube, meta, obj["status"]["usage"]), created_at(body.meta))
    try:
        spec = parse_spec(body.spec)
        check_policy(spec, ctx.settings)
        check_name(meta["name"], spec)
    except SpecError as error:  # nothing is applied, but the pods that serve are booked all the same
        await keep_books(ctx, body, memory, obj, meta, Observed(generation, invalid_verdicts(error), fields))
        return
    labels = dict(body.meta.get("labels") or {})
    spec, applied = with_budgets(spec, meta, labels, platform, int(obj["status"].get("readyReplicas") or 0))
    if applied is not None and applied.reason == "SpecBudgets" and not memory.spec_budgets_noted:
        ctx.post_event(body, "Warning", "SpecBudgetsDeprecated", applied.message)
        memory.spec_budgets_noted = True
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
    spec, applied = with_budgets(spec, meta, labels, platform, len(leasable_uids(pods)))
    memory.budgeted = spec.budgets is not None
    budget_verdicts = [applied] if applied is not None else []
    if memory.apply_error is not None:  # until a pass applies cleanly, the rejection is the news (and books go on)
        observed = Observed(generation, [*invalid_verdicts(memory.apply_error), *budget_verdicts], fields,
                            max_mismatch_ratio=spec.max_mismatch_ratio, budgets=spec.budgets, keep=kept_status(spec))
        await keep_books(ctx, body, memory, obj, meta, observed, spec.scrape_interval_seconds)
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
    verdicts = [*workload_verdicts(spec, deployment, pods), *budget_verdicts]
    if spec.pool is not None:
        fields["routing"], routed = await asyncio.to_thread(pool_status, ctx, meta, spec)
        verdicts.append(routed)
        ready = 1 if fields["routing"]["pickerReady"] else 0
        ctx.metrics.picker_ready.labels(meta["namespace"], meta["name"]).set(ready)
    # Without our Deployment (deleted with --cascade=orphan, say) its pods are not gone: they are re-adopted
    # when it is back, so the ledger waits rather than count them lost and then book them whole again
    due = deployment is not None and scrape_due(memory, spec.scrape_interval_seconds)

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
                        spec.max_mismatch_ratio, spec.budgets, leasable_uids(pods),
                        keep=kept_status(spec)), scraped

    landed_round = await commit(ctx, body, memory, obj, observe, books=due)
    if landed_round is not None and landed_round.decision is not None:
        await rescale(ctx, body, meta, spec, memory, landed_round, pods)

async def keep_books(ctx: Context, body: kopf.Body, memory: ServiceMemory, obj: Mapping[str, Any],
                     meta: Mapping[str, str], observed: Observed, interval: float = DEFAULT_SCRAPE_SECONDS) -> None:
    """A pass that cannot do its work (a spec it must refuse, a child the API server refused or someone else
    owns) still books what the service's pods served, and acknowledges the drained ones: they keep serving
    whatever the spec says now, and stopping the books would lose their usage (and keep drained pods waiting
    for a final read). The status says why the rest was not done."""
    try:
        deployment, pods = await asyncio.to_thread(read_children, ctx, meta)
    except SpecError:  # the Deployment is someone else's: no pod of ours to book
        deployment, pods = None, []
    due = deployment is not None and scrape_due(memory, interval)

    async def observe(current: Mapping[str, Any]) -> tuple[Observed, Scraped | None]:
        scraped = await scrape_round(ctx, meta, pods, current) if due else None
        serving = leasable_uids(pods) if observed.budgets is not None else frozenset()
        return replace(observed, round=scraped.round if scraped else None, serving=serving), scraped

    await commit(ctx, body, memory, obj, observe, books=due)


def kept_status(spec: Spec) -> frozenset[str]:
    """What a pass keeps of the persisted status when it does not write it anew: the ledger always, and what
    the features that are on wrote (a scrape round writes autoscaling's; another pass keeps it). The status of a
    feature switched off goes."""
    return frozenset({"usage", *(["budgets"] if spec.budgets is not None else []),
                      *(["autoscaling"] if spec.autoscaling is not None else []),
                      *(["routing"] if spec.pool is not None else [])})
