"""Autoscaling as a pass carries it out: the count to continue from (the Deployment's), this round's decision on
what was scraped (autoscale.py decides, purely), and once the status holding it has landed the scale itself
(idle pods first out)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf

from tally_operator.activation import Held, read_held
from tally_operator.autoscale import (
    Autoscaling,
    Decision,
    Observation,
    clamp,
    decide,
    deletion_cost,
    round_signal,
    with_floor,
    zero_step,
)
from tally_operator.books import now
from tally_operator.children import route
from tally_operator.context import Context, Scaling, Scraped, ServiceMemory
from tally_operator.desired import (
    desired_deployment,
)
from tally_operator.pods import is_ready
from tally_operator.spec import Spec
from tally_operator.status import (
    unschedulable_message,
)
from tally_operator.usage import (
    controller_uid,
)
from tally_runtime import contract

log = logging.getLogger("tally_operator")


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

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
    traffic = busy(scraped, loads, held, len(serving), scaling.requests_seen)
    if traffic:
        scaling = replace(scaling, active_at=at)
    decision = zero_step(config, decision, current, held, None if traffic else at - scaling.active_at)
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
