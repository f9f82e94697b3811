"""Scale to zero, the pure parts: the steps to and from zero around the windows' decision, traffic as the
operator sees it in a round, the activator's objects and where the Service points, and an activator's
answer read as hostile input."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tally_operator import constants as c
from tally_operator import scaling as scaling_pass
from tally_operator.activation import Held, parse_held
from tally_operator.autoscale import Autoscaling, Decision, zero_step
from tally_operator.context import Scaling, Scraped
from tally_operator.desired import (
    desired_activator,
    desired_backend_service,
    desired_deployment,
    desired_service,
    routes_to_activator,
)
from tally_operator.samples import Counters, PodSample
from tally_operator.scaling import autoscale
from tally_operator.settings import OperatorSettings
from tally_operator.spec import parse_spec
from tally_operator.usage import Round
from tally_runtime import contract

ZERO = Autoscaling(min_replicas=0, max_replicas=4, metric="queuedRequests", target=4.0, stable_window_seconds=30,
                   panic_window_seconds=6, scale_down_delay_seconds=30, scale_to_zero_grace_seconds=60)
STEADY = Decision(1, "Steady", "")
META = {"name": "chat", "namespace": "team", "uid": "u-1"}
SPEC = {"model": {"name": "m"}, "engine": {"kind": "cpu"}, "resources": {"gpus": 0},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZero": {"holdSeconds": 30, "maxHeldRequests": 8}}}


@pytest.mark.parametrize(("current", "held", "idle", "replicas", "reason"), [
    (0, 3, 0, 1, "Activated"),  # a held request starts a pod, whatever the windows say
    (0, 0, 1e6, 0, "Idle"),
    (1, 0, 61, 0, "ScaledToZero"),
    (1, 0, 59, 1, "Steady"),  # not before the grace
    (1, 1, 1e6, 1, "Steady"),  # never while something is held
    (2, 0, 1e6, 1, "Steady"),  # only from one pod: the windows bring it there first
])
def test_the_steps_to_and_from_zero(current: int, held: int, idle: float, replicas: int, reason: str) -> None:
    decision = zero_step(ZERO, STEADY, current, held, idle)
    assert (decision.replicas, decision.reason) == (replicas, reason)


def test_with_a_floor_of_one_nothing_changes() -> None:
    one = Autoscaling(min_replicas=1, max_replicas=4, metric="queuedRequests", target=4.0)
    assert zero_step(one, STEADY, 1, 0, 1e9) is STEADY


def pod(uid: str) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "name": uid},
            "status": {"podIP": "198.18.0.9", "conditions": [{"type": "Ready", "status": "True"}]}}


def sample(requests: float, running: float = 0.0) -> PodSample:
    return PodSample(Counters(requests=requests), "incremental", None, 1.0, all_requests=requests,
                     load={contract.QUEUED_REQUESTS: 0.0, contract.INFLIGHT_GENERATIONS: running})


def test_one_pod_goes_to_zero_after_a_grace_of_no_traffic_and_any_traffic_restarts_the_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(scaling_pass.time, "monotonic", lambda: clock[0])
    scaling = Scaling(since=0.0, active_at=1000.0)
    decisions: list[tuple[int, str]] = []
    # seconds 0-40 a request now and then (the counter moves), one running at 40; then nothing at all
    for second in range(0, 130, 5):
        clock[0] = 1000.0 + second
        requests = min(second, 40) // 10
        samples = {"p": sample(requests, running=1.0 if second == 40 else 0.0)}
        scraped = autoscale(ZERO, 1, [pod("p")], Scraped(Round(samples, frozenset()), {}, {}, held=Held()), scaling)
        assert scraped.decision is not None and scraped.scaling is not None
        scaling = scraped.scaling
        decisions.append((second, scraped.decision.replicas))
    first_zero = next(second for second, replicas in decisions if replicas == 0)
    assert first_zero == 100  # the last traffic at 40 (a generation running), then a grace of 60


def test_a_grace_of_zero_means_after_the_first_idle_round_never_on_a_busy_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`graceSeconds: 0` scaled a busy pod to zero on the first round (the round's own traffic set the clock it
    was compared with, and 0 >= 0). Busy rounds keep the pod; the first round without traffic takes it away."""
    clock = [2000.0]
    monkeypatch.setattr(scaling_pass.time, "monotonic", lambda: clock[0])
    eager = replace(ZERO, scale_to_zero_grace_seconds=0)
    scaling = Scaling(since=0.0, active_at=2000.0)
    replicas = []
    for step, (requests, running) in enumerate([(1, 1.0), (2, 1.0), (3, 0.0), (3, 0.0)]):
        clock[0] = 2000.0 + 5 * step
        scraped = autoscale(eager, 1, [pod("p")], Scraped(Round({"p": sample(requests, running)}, frozenset()), {},
                                                          {}, held=Held()), scaling)
        assert scraped.decision is not None and scraped.scaling is not None
        scaling = scraped.scaling
        replicas.append(scraped.decision.replicas)
    assert replicas == [1, 1, 1, 0]  # the third round still counted a request (3 since 2): traffic; the fourth none


def test_a_pod_not_read_or_a_held_request_is_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaling_pass.time, "monotonic", lambda: 5000.0)
    idle = Scaling(since=0.0, active_at=0.0, requests_seen={"p": 3.0})
    unread = autoscale(ZERO, 1, [pod("p")], Scraped(Round({}, frozenset({"p"})), {}, {}, held=Held()), idle)
    held = autoscale(ZERO, 1, [pod("p")], Scraped(Round({"p": sample(3.0)}, frozenset()), {}, {},
                                                  held=Held(requests=2)), idle)
    quiet = autoscale(ZERO, 1, [pod("p")], Scraped(Round({"p": sample(3.0)}, frozenset()), {}, {}, held=Held()), idle)
    assert unread.decision is not None and unread.decision.replicas == 1
    assert held.decision is not None and held.decision.replicas == 1
    assert quiet.decision is not None and quiet.decision.reason == "ScaledToZero"


def test_the_activator_runs_the_operators_image_without_gpu_keys_or_api_access() -> None:
    settings = OperatorSettings(runtime_image="rt:1", cluster_domain="cluster.local")
    spec = parse_spec({**SPEC, "image": "someone-else:2", "resources": {"gpus": 1}})
    activator = desired_activator(META, spec, settings)
    assert activator is not None
    pod_spec = activator["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    assert container["image"] == "rt:1" and "nvidia.com/gpu" not in str(container["resources"])
    assert pod_spec["automountServiceAccountToken"] is False and "volumes" not in container
    assert not any(m.get("secret") for m in pod_spec["volumes"])
    assert container["args"][:6] == ["activate", "--service", "team/chat", "--backend",
                                     "http://chat-pods.team.svc.cluster.local:8000", "--port"]
    assert container["args"][-6:] == ["--max-held", "8", "--hold-seconds", "30", "--max-body-bytes", str(4 << 20)]
    assert container["command"] == ["/opt/tally/bin/tally-runtime"]
    # its memory holds every body it may have in hand (8 requests of 4 MiB, twice) over the process itself
    assert container["resources"]["limits"]["memory"] == f"{128 + 8 * 8}Mi"
    labels = activator["spec"]["template"]["metadata"]["labels"]
    assert c.LABEL_SERVICE not in labels, "the runtime's selector (its pods, the ledger's) must not match it"
    assert activator["spec"]["selector"]["matchLabels"] == {c.LABEL_ACTIVATOR: "chat"}
    assert activator["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert labels[c.LABEL_MANAGED_BY] == c.FIELD_MANAGER
    # a service at zero starts at zero pods
    assert desired_deployment(META, spec, settings)["spec"]["replicas"] == spec.replicas


def test_the_service_points_at_the_activator_or_the_pods_and_the_backend_always_at_the_pods() -> None:
    spec = parse_spec(SPEC)
    to_activator, to_pods = desired_service(META, to_activator=True), desired_service(META)
    backend = desired_backend_service(META, spec)
    assert to_activator["spec"]["selector"] == {c.LABEL_ACTIVATOR: "chat"} and routes_to_activator(to_activator)
    assert to_pods["spec"]["selector"] == {c.LABEL_SERVICE: "chat"} and not routes_to_activator(to_pods)
    assert backend is not None and backend["metadata"]["name"] == "chat-pods"
    assert backend["spec"]["selector"] == {c.LABEL_SERVICE: "chat"}
    assert not routes_to_activator(None)
    plain = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"},
                        "autoscaling": {"minReplicas": 1, "maxReplicas": 2}})
    assert desired_activator(META, plain, OperatorSettings()) is None
    assert desired_backend_service(META, plain) is None


@pytest.mark.parametrize("text", [
    "not json", "[]", '{"held": -1}', '{"held": 1.5}', '{"held": true}', '{"held": 10000000}',
    '{"held": 1, "lastColdStartSeconds": "x"}', '{"held": 1, "lastColdStartSeconds": 1e309}',
    '{"held": 1, "lastColdStartSeconds": -3}', '{}',
])
def test_an_answer_that_is_not_an_activators_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_held(text)


def test_an_activators_answer() -> None:
    assert parse_held('{"held": 3, "lastColdStartSeconds": 12.5}') == (3, 12.5)
    assert parse_held('{"held": 0, "lastColdStartSeconds": null}') == (0, None)
