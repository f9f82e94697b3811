"""PURE: observed children (and usage) -> the CompletionService status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tally_operator import constants as c
from tally_operator.conditions import Condition, Verdict, set_condition
from tally_operator.spec import Spec, SpecError


def unschedulable_message(pods: Sequence[Mapping[str, Any]]) -> str:
    """The scheduler's own words for the first pod it could not place, if any."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return str(cond.get("message") or "no node can run the pod")
    return ""


def _deployment_condition(deployment: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def workload_verdicts(spec: Spec, deployment: Mapping[str, Any] | None,
                      pods: Sequence[Mapping[str, Any]]) -> list[Verdict]:
    """Ready, Progressing and Degraded from the Deployment and its pods."""
    status = (deployment or {}).get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    current = deployment is not None and status.get("observedGeneration", -1) >= (deployment.get("metadata") or {}).get(
        "generation", 0)
    rolled_out = current and updated >= spec.replicas and total == spec.replicas and ready >= spec.replicas
    stuck = unschedulable_message(pods)
    deadline = _deployment_condition(deployment or {}, "Progressing").get("reason") == REASON_DEADLINE_K8S
    failure = _deployment_condition(deployment or {}, "ReplicaFailure")

    # Ready says the service serves at the capacity it has: pods still starting for a scale-up (every pod on
    # the current template, none of the not-ready ones ever restarted) are Progressing, not a failure
    not_ready = [p for p in pods if not _pod_ready(p)]
    scaling_up = bool(current and not rolled_out and 0 < ready < spec.replicas and updated >= total and not_ready
                      and all(map(_starting, not_ready)))
    if spec.replicas == 0:
        ready_v = Verdict(c.READY, "True", c.REASON_SCALED_TO_ZERO, "Scaled to zero replicas")
    elif rolled_out or (current and ready >= spec.replicas):  # at full capacity, a rollout under way or not
        ready_v = Verdict(c.READY, "True", c.REASON_AVAILABLE, f"{ready} of {spec.replicas} pods ready")
    elif scaling_up:
        ready_v = Verdict(c.READY, "True", c.REASON_SCALING_UP,
                          f"{ready} of {spec.replicas} pods ready; the others are starting")
    else:
        reason = c.REASON_UNSCHEDULABLE if stuck else c.REASON_WAITING
        ready_v = Verdict(c.READY, "False", reason, f"{ready} of {spec.replicas} pods ready")

    if rolled_out or spec.replicas == 0:
        progressing = Verdict(c.PROGRESSING, "False", c.REASON_STABLE, "The rollout is complete")
    elif stuck:
        progressing = Verdict(c.PROGRESSING, "True", c.REASON_UNSCHEDULABLE, f"Pods cannot be scheduled: {stuck}")
    elif scaling_up:
        progressing = Verdict(c.PROGRESSING, "True", c.REASON_SCALING_UP,
                              f"Scaling up to {spec.replicas} pods, {ready} ready")
    else:
        progressing = Verdict(c.PROGRESSING, "True", c.REASON_ROLLING_OUT,
                              f"{updated} of {spec.replicas} pods updated, {ready} ready")

    if deadline:
        degraded = Verdict(c.DEGRADED, "True", c.REASON_DEADLINE, "The rollout exceeded its progress deadline")
    elif failure.get("status") == "True":
        degraded = Verdict(c.DEGRADED, "True", c.REASON_REPLICA_FAILURE, str(failure.get("message") or ""))
    else:
        degraded = Verdict(c.DEGRADED, "False", c.REASON_HEALTHY, "No failures observed")
    return [ready_v, progressing, degraded]


REASON_DEADLINE_K8S = "ProgressDeadlineExceeded"


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(cond.get("type") == "Ready" and cond.get("status") == "True"
               for cond in (pod.get("status") or {}).get("conditions") or [])


def _starting(pod: Mapping[str, Any]) -> bool:
    """A pod that has not served yet: never restarted, not terminating (a pod that was ready and failed is
    lost capacity, not capacity coming)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return True  # leaving, as in a scale-down: not a failure either
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return all(int(cs.get("restartCount") or 0) == 0 for cs in statuses)


def invalid_verdicts(error: SpecError) -> list[Verdict]:
    return [
        Verdict(c.READY, "False", error.reason, error.message),
        Verdict(c.PROGRESSING, "False", error.reason, "Nothing is rolled out until the spec is fixed"),
        Verdict(c.DEGRADED, "True", error.reason, error.message),
    ]


def build_status(previous: Mapping[str, Any], verdicts: Sequence[Verdict], now: str, generation: int,
                 fields: Mapping[str, Any], keep: frozenset[str] | None = None) -> dict[str, Any]:
    """The whole new status (it is written whole, replacing the persisted one): the given fields, the persisted
    keys named in `keep` that the pass did not set (None: every persisted key), conditions updated in place."""
    conditions: list[Condition] = list(previous.get("conditions") or [])
    for verdict in verdicts:
        conditions = set_condition(conditions, verdict, now, generation)
    order = {c.READY: 0, c.PROGRESSING: 1, c.DEGRADED: 2, c.USAGE_HEALTHY: 3}
    conditions.sort(key=lambda cond: order.get(cond["type"], 9))
    status: dict[str, Any] = {k: v for k, v in previous.items() if keep is None or k in keep}
    status.update(fields)
    status["observedGeneration"] = generation
    status["conditions"] = conditions
    return status


def observed_fields(name: str, deployment: Mapping[str, Any] | None, endpoint: str) -> dict[str, Any]:
    status = (deployment or {}).get("status") or {}
    return {
        "replicas": int(status.get("replicas") or 0),
        "readyReplicas": int(status.get("readyReplicas") or 0),
        "updatedReplicas": int(status.get("updatedReplicas") or 0),
        "selector": f"{c.LABEL_SERVICE}={name}",
        "endpoint": endpoint,
    }


def without_times(status: Mapping[str, Any]) -> dict[str, Any]:
    """Status compared for change detection (a new timestamp alone is no change)."""
    out = dict(status)
    out["conditions"] = [{k: v for k, v in cond.items() if k != "lastTransitionTime"}
                         for cond in status.get("conditions") or []]
    return out
