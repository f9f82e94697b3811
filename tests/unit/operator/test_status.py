"""Status from the Deployment and its pods: Ready, Progressing, Degraded, and the whole status object."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator.conditions import Verdict
from tally_operator.spec import parse_spec
from tally_operator.status import build_status, without_times, workload_verdicts

SPEC = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}, "replicas": 2})


def deployment(ready: int, updated: int = 2, replicas: int = 2, **conditions: str) -> dict[str, Any]:
    return {"metadata": {"generation": 3}, "status": {
        "observedGeneration": 3, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
        "conditions": [{"type": k, "status": "True", "reason": v} for k, v in conditions.items()]}}


def pod(ready: bool, restarts: int = 0) -> dict[str, Any]:
    return {"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": str(ready)}],
                                       "containerStatuses": [{"restartCount": restarts}]}}


def by_type(verdicts: list[Verdict]) -> dict[str, Verdict]:
    return {v.type: v for v in verdicts}


@pytest.mark.parametrize(("dep", "pods", "ready", "progressing"), [
    pytest.param(deployment(2), [], ("True", "AllReplicasReady"), ("False", "Stable"), id="ready"),
    pytest.param(deployment(1), [], ("False", "WaitingForPods"), ("True", "RollingOut"), id="rolling"),
    pytest.param(deployment(2, updated=1, replicas=3), [], ("True", "AllReplicasReady"), ("True", "RollingOut"),
                 id="a-rollout-at-full-capacity-still-serves"),
    pytest.param(None, [], ("False", "WaitingForPods"), ("True", "RollingOut"), id="no-deployment-yet"),
    pytest.param(deployment(1), [pod(ready=True), pod(ready=False)], ("True", "ScalingUp"), ("True", "ScalingUp"),
                 id="a-scale-up-is-progress-not-a-failure"),
    pytest.param(deployment(1), [pod(ready=True), pod(ready=False, restarts=3)], ("False", "WaitingForPods"),
                 ("True", "RollingOut"), id="a-crashing-pod-is-lost-capacity"),
    pytest.param(deployment(0, 0), [{"status": {"conditions": [{"type": "PodScheduled", "reason": "Unschedulable",
                 "message": "0/2 nodes: Insufficient nvidia.com/gpu"}]}}], ("False", "Unschedulable"),
                 ("True", "Unschedulable"), id="no-gpus"),
])
def test_workload_verdicts(dep: dict[str, Any] | None, pods: list[dict[str, Any]], ready: tuple[str, str],
                           progressing: tuple[str, str]) -> None:
    verdicts = by_type(workload_verdicts(SPEC, dep, pods))
    assert (verdicts["Ready"].status, verdicts["Ready"].reason) == ready
    assert (verdicts["Progressing"].status, verdicts["Progressing"].reason) == progressing


def test_degraded_on_deadline() -> None:
    verdicts = by_type(workload_verdicts(SPEC, deployment(1, Progressing="ProgressDeadlineExceeded"), []))
    assert verdicts["Degraded"].status == "True"


def test_build_status_keeps_usage_and_orders_conditions() -> None:
    previous = {"usage": {"requests": 3}, "conditions": [{"type": "UsageHealthy", "status": "True", "reason": "x",
                                                         "message": "", "lastTransitionTime": "t0"}]}
    status = build_status(previous, workload_verdicts(SPEC, deployment(2), []), "t1", 3, {"replicas": 2})
    assert status["usage"] == {"requests": 3} and status["observedGeneration"] == 3
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "UsageHealthy"]
    assert without_times(status) == without_times(build_status(status, [], "t9", 3, {"replicas": 2}))
