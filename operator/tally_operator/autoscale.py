"""PURE: how many pods a service should run, from the signal its pods report (the scrape reads it anyway).

The shape is Knative's KPA, which AIBrix and KubeAI follow: the desired count is the signal summed over the
pods divided by a target per pod, averaged over a stable window; a short panic window reacts to bursts
(panic when it asks for at least twice the pods running: then never scale down); growth per decision is
bounded; a scale-down happens only when every recommendation over the scale-down delay was below the
current count. Two things are GPU-specific:

- pods still starting are capacity that is coming: while any pod is not ready, the count grows further
  only in panic (demand at least twice what runs or is coming), bounded per step as always (a model load
  takes minutes; the queue grows meanwhile and would otherwise ask for pods that are already on their way);
- a pod the scheduler cannot place (no GPU free) stops growth altogether and says so (`CapacityUnavailable`)
  instead of asking for ever more pods that will not run.

What it cannot see it does not decide on (Knative makes no decision without data; the HPA takes missing
pods as at target when scaling down): a pod whose /metrics could not be read counts as exactly at target
(it asks for neither more pods nor fewer), a round that read no pod adds nothing to the history, and no
round scales down to more pods than it read. A scale-down removes at most half the pods per step
(Knative's maximum scale-down rate of 2), and every number a spec can hold gives a decision, never an error.

Defaults (and why they differ from KPA's 60 s stable / 6 s panic, AIBrix's 180 s / 60 s and 300 s delay):
a 300 s stable window, a 60 s panic window, at most 2x per step, and a 600 s scale-down delay. A GPU pod takes
minutes to start and a removed one is expensive to get back, so Tally reacts to bursts as fast as AIBrix but
gives capacity up more slowly than any of them.

Scale to zero (`minReplicas: 0`) is two steps outside those windows (`zero_step`): from zero, one pod as soon
as the activator holds a request (Knative's activation); to zero, only from one pod, after the scale-to-zero
grace with no traffic at all (no request counted, nothing running, queued or held). Between them the
windows above decide as with `minReplicas: 1`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tally_operator.conditions import SCALING_LIMITED, Verdict  # ScalingLimited: True while held back
from tally_runtime import contract

# The signals a target can be set on, and the series each is read from (summed over a service's pods).
QUEUED_REQUESTS = "queuedRequests"  # tally_queued_requests: requests waiting for a generation slot
BUSY_SLOTS = "busySlots"  # tally_inflight_generations / the pod's slots: a fraction per pod
SGLANG_QUEUE = "sglangQueue"  # sglang:num_queue_reqs: requests waiting in SGLang's own scheduler
KV_CACHE = "kvCacheUsage"  # sglang:token_usage: the KV cache in use, a fraction per pod
METRICS = (QUEUED_REQUESTS, BUSY_SLOTS, SGLANG_QUEUE, KV_CACHE)
PANIC_THRESHOLD = 2.0  # panic when the panic window asks for this many times the pods running
MAX_SCALE_DOWN_RATE = 2.0  # a scale-down keeps at least current / this many pods
MAX_WANTED = 1_000_000  # more pods than any service runs: what a signal asks for is capped here


@dataclass(frozen=True, slots=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metric: str
    target: float  # of the metric, per pod
    stable_window_seconds: float = 300.0
    panic_window_seconds: float = 60.0
    scale_down_delay_seconds: float = 600.0
    max_scale_up_rate: float = 2.0
    scale_to_zero_grace_seconds: float = 900.0  # with min_replicas 0: idle this long, then no pod
    hold_seconds: float = 600.0  # with min_replicas 0: how long the activator holds a request
    max_held_requests: int = 64  # with min_replicas 0: the activator's queue, per activator pod
    activator_replicas: int = 2

    @property
    def scales_to_zero(self) -> bool:
        return self.min_replicas == 0


@dataclass(frozen=True, slots=True)
class Observation:
    at: float  # monotonic seconds
    signal: float  # the metric summed over the pods scraped


@dataclass(frozen=True, slots=True)
class Recommendation:
    at: float
    replicas: int  # before the scale-down delay


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str  # Steady, ScaleUp, Panic, ScaleDown, PodsStarting, CapacityUnavailable, AtMax, Bounds, NoSignal,
    # Activated, ScaledToZero, Idle
    message: str
    stable_signal: float | None = None
    panic_signal: float | None = None
    recommendation: Recommendation | None = None  # to remember for the scale-down delay


def average(history: Sequence[Observation], now: float, window: float) -> float | None:
    values = [o.signal for o in history if o.at > now - window]
    return sum(values) / len(values) if values else None


def pods_for(value: float) -> int:
    """ceil(value), total: for any float (a hostile target makes signal / target infinite), capped."""
    return math.ceil(value) if value < MAX_WANTED else MAX_WANTED


def decide(config: Autoscaling, history: Sequence[Observation], recommendations: Sequence[Recommendation],
           current: int, ready: int, unschedulable: bool, now: float, since: float,
           read: int | None = None) -> Decision:
    """The replicas to run now. `current` is the replicas asked for so far (pods starting included),
    `ready` those serving; `recommendations` the earlier ones within the delay; `since` when this memory
    began (no scale-down before it covers the whole delay: a restarted operator is not that sure); `read`
    the pods whose signal this round read (None: all of them)."""
    if clamp(current, config) != current:  # the bounds moved (a spec change): follow them at once
        return Decision(clamp(current, config), "Bounds", f"minReplicas {config.min_replicas}, maxReplicas "
                                                          f"{config.max_replicas}: {clamp(current, config)} pod(s)")
    stable = average(history, now, config.stable_window_seconds)
    panic = average(history, now, config.panic_window_seconds)
    if stable is None or panic is None:
        return Decision(clamp(current, config), "NoSignal", "No signal in the stable window: keeping the pods")
    want_stable = pods_for(stable / config.target)
    want_panic = pods_for(panic / config.target)
    panicking = current > 0 and want_panic >= PANIC_THRESHOLD * current
    want = max(want_panic, current) if panicking else want_stable
    recommendation = Recommendation(now, clamp(want, config))

    def decision(replicas: int, reason: str, message: str) -> Decision:
        return Decision(replicas, reason, message, stable, panic, recommendation)

    metric = config.metric
    if want > current:
        if unschedulable:
            return decision(current, "CapacityUnavailable", f"{want} pod(s) wanted, but the scheduler cannot place "
                                                            "the pods asked for already (no GPU free)")
        if ready < current and not panicking:
            return decision(current, "PodsStarting", f"{want} pod(s) wanted; {current - ready} pod(s) still "
                                                     "starting count as capacity that is coming")
        target = clamp(min(want, max(current + 1, pods_for(current * config.max_scale_up_rate))), config)
        if target <= current:
            return decision(current, "AtMax", f"{want} pod(s) wanted; maxReplicas is {config.max_replicas}")
        return decision(target, "Panic" if panicking else "ScaleUp",
                        f"{metric} asks for {want} pod(s): {target} now (at most {config.max_scale_up_rate:g}x "
                        "per step)")
    if want < current:
        window = [r.replicas for r in recommendations if r.at > now - config.scale_down_delay_seconds]
        held = max([*window, recommendation.replicas])
        if now - since < config.scale_down_delay_seconds or held >= current:
            return decision(current, "Steady", f"{metric} asks for {want} pod(s); scaling down waits for "
                                               f"{config.scale_down_delay_seconds:g}s of that")
        target = clamp(max(held, pods_for(current / MAX_SCALE_DOWN_RATE)), config)
        if read is not None and read < target:
            return decision(current, "PodsUnread", f"{metric} asks for {want} pod(s), but only {read} of the pods "
                                                   f"were read: no scale-down to {target} on what it cannot see")
        return decision(target, "ScaleDown", f"{metric} averaged {stable:.2f} over "
                                             f"{config.stable_window_seconds:g}s: {target} pod(s)")
    return decision(clamp(current, config), "Steady", f"{metric} averaged {stable:.2f}: {current} pod(s)")


def zero_step(config: Autoscaling, decision: Decision, current: int, held: int, idle_seconds: float | None) -> Decision:
    """With `minReplicas: 0`, the steps to and from zero around the windows' `decision` (made with a floor of
    one pod): from zero, one pod once anything is held; to zero, from one pod, once nothing was held, ran,
    queued or counted for the whole grace. `idle_seconds` is None when this very round saw traffic: a grace of 0
    means after the first idle round, never on a busy one."""
    if not config.scales_to_zero:
        return decision
    if current == 0:
        if held:
            return Decision(1, "Activated", f"{held} request(s) held by the activator: starting a pod")
        return Decision(0, "Idle", "No pod and no request held")
    if current == 1 and decision.replicas <= 1 and not held and idle_seconds is not None \
            and idle_seconds >= config.scale_to_zero_grace_seconds:
        return replace(decision, replicas=0, reason="ScaledToZero",
                       message=f"No traffic for {idle_seconds:.0f}s (grace {config.scale_to_zero_grace_seconds:g}s): "
                               "no pod; the activator holds the next request")
    return decision


def with_floor(config: Autoscaling) -> Autoscaling:
    """The windows' config: with scale to zero, they decide as if the floor were one pod."""
    return replace(config, min_replicas=max(1, config.min_replicas))


def clamp(replicas: int, config: Autoscaling) -> int:
    return max(config.min_replicas, min(config.max_replicas, replicas))


def load_signal(metric: str, loads: Sequence[Mapping[str, float]]) -> float:
    """The metric summed over the pods scraped (each pod's gauges as its sample read them)."""
    if metric == BUSY_SLOTS:
        return sum(load.get(contract.INFLIGHT_GENERATIONS, 0.0) / max(1.0, load.get(contract.GENERATION_SLOTS, 1.0))
                   for load in loads)
    names = {QUEUED_REQUESTS: (contract.QUEUED_REQUESTS,), SGLANG_QUEUE: contract.SGLANG_QUEUE_GAUGES,
             KV_CACHE: (contract.SGLANG_KV_CACHE_USAGE,)}[metric]
    return sum(load.get(name, 0.0) for load in loads for name in names)


UNREAD_DELETION_COST = 2**31 - 1  # the annotation is an int32: a pod not read may be busy, so it goes last


def deletion_cost(load: Mapping[str, float] | None) -> int:
    """`controller.kubernetes.io/pod-deletion-cost` for a pod: the ReplicaSet removes the cheapest first, so
    an idle pod goes before a busy one (its drain and final read are then the shortest); a pod whose load
    was not read (None) may be the busiest, so it goes last."""
    if load is None:
        return UNREAD_DELETION_COST
    return int(load.get(contract.INFLIGHT_GENERATIONS, 0.0) + load.get(contract.QUEUED_REQUESTS, 0.0))


def round_signal(metric: str, target: float, loads: Sequence[Mapping[str, float]], unread: int) -> float | None:
    """The signal of one round: what the pods read say, with each pod not read counted as at target; None
    when no pod was read (a blind round is no observation)."""
    if not loads:
        return None
    return load_signal(metric, loads) + unread * target


def scaling_verdict(decision: Decision) -> Verdict:
    if decision.reason in {"AtMax", "CapacityUnavailable"}:
        return Verdict(SCALING_LIMITED, "True", decision.reason, decision.message)
    return Verdict(SCALING_LIMITED, "False", "WithinBounds", decision.message)


def scaling_status(config: Autoscaling, decision: Decision, current: int, ready: int,
                   last_scale_time: str | None) -> dict[str, object]:
    status: dict[str, object] = {"metric": config.metric, "target": config.target, "desiredReplicas": decision.replicas,
                                 "currentReplicas": current, "readyReplicas": ready, "reason": decision.reason}
    if decision.stable_signal is not None and decision.panic_signal is not None:
        status |= {"stableSignal": round(decision.stable_signal, 3), "panicSignal": round(decision.panic_signal, 3)}
    if last_scale_time:
        status["lastScaleTime"] = last_scale_time
    return status
