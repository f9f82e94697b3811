"""Autoscaling on the real node: the CPU example grows from 1 to 3 pods under a bounded load through its
Service, shrinks back to 1 once the load stops, and status.usage equals what the clients received."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from kube_harness import Kubectl, container_id, eventually, in_cluster, node_ctr, reachable_cluster_ip
from operator_harness import ChartOperator
from usage_harness import MODEL, ClientThreads, live_pods, service, status, totals_match

pytestmark = pytest.mark.e2e

CLIENTS = 6
LOAD_SECONDS = 240  # the load stops earlier, once three pods are ready


def scaling(kube: Kubectl) -> dict[str, Any]:
    return dict(status(kube).get("autoscaling") or {})


def ready_pods(kube: Kubectl) -> int:
    return sum(1 for p in live_pods(kube) if any(c["type"] == "Ready" and c["status"] == "True"
                                                 for c in p["status"].get("conditions") or []))


class Load(ClientThreads):
    """`CLIENTS` clients sending completions to the Service back to back until stopped (or a deadline)."""

    def __init__(self, url: str) -> None:
        super().__init__(CLIENTS)
        self.url = url
        self.refused: list[httpx.Response] = []
        self.unreachable: list[float] = []  # when requests were sent that could not connect: no pod was ready

    def client(self, i: int) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        with in_cluster(120) as http:
            while not self.stop.is_set() and time.monotonic() < deadline:
                sent = time.monotonic()
                try:
                    response = http.post(self.url, json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 24,
                                                         "ignore_eos": True})
                except httpx.HTTPError as err:
                    with self.lock:
                        if not_connected(err):
                            self.unreachable.append(sent)
                        else:
                            self.failures.append(f"{type(err).__name__}: {err}")
                    self.stop.wait(0.5)  # as a client backs off before it retries
                    continue
                with self.lock:
                    if response.status_code == 200:
                        usage = response.json()["usage"]
                        self.received.append({"prompt": usage["prompt_tokens"],
                                              "completion": usage["completion_tokens"]})
                    elif response.status_code == 503 and response.headers.get("retry-after"):
                        self.refused.append(response)
                    else:
                        self.failures.append(f"{response.status_code}: {response.text[:200]}")


def served_enough(load: Load, count: int, deadline: float) -> None:
    """Wait until the load has `count` answers; on a timeout, say what its clients got instead."""
    try:
        eventually(lambda: load.served() > count, deadline, interval=1, what="enough requests served to count")
    except AssertionError as err:
        with load.lock:
            raise AssertionError(f"{err}; served {len(load.received)}, refused {len(load.refused)}, unreachable "
                                 f"{len(load.unreachable)}, failures {load.failures[:3]}") from None


def not_connected(err: httpx.HTTPError) -> bool:
    """A request that never left the client: the Service's ClusterIP refused the connection (kube-proxy
    rejects connections to a Service without a ready endpoint), reported through the tests' SOCKS relay."""
    return isinstance(err, httpx.ConnectError) or (isinstance(err, httpx.ProxyError)
                                                   and "could not connect" in str(err))


def reachable_service(kube: Kubectl) -> str:
    """The Service's URL once its ClusterIP takes connections (kube-proxy lags the EndpointSlices)."""
    return f"http://{reachable_cluster_ip(kube, 'smollm', 8000)}:8000/v1/completions"


def autoscaled(max_replicas: int, window: int = 20, panic: int = 6) -> dict[str, Any]:
    """The CPU example with one slot a pod (the queue is the load) and short windows."""
    manifest = service(replicas=1)
    manifest["spec"]["engine"]["maxConcurrentGenerations"] = 1
    manifest["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": max_replicas, "metric": "queuedRequests",
                                       "target": 1, "stableWindowSeconds": window, "panicWindowSeconds": panic,
                                       "scaleDownDelaySeconds": window}
    return manifest


def test_the_service_grows_under_load_and_shrinks_after_with_every_token_counted(
        operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(autoscaled(max_replicas=3))
    eventually(lambda: ready_pods(kube) == 1, 180, interval=1, what="one ready pod")
    url = reachable_service(kube)
    stepped = time.monotonic()
    with Load(url) as load:
        eventually(lambda: scaling(kube).get("desiredReplicas", 0) >= 2, 90, interval=1, what="a scale-up decided")
        first_new = eventually(lambda: ready_pods(kube) >= 2 and time.monotonic(), 180, interval=1,
                               what="a second pod ready")
        eventually(lambda: ready_pods(kube) == 3, 240, interval=1, what="three pods ready")
        served_enough(load, 10, 120)
    print(f"\n[autoscaling] first new pod ready {first_new - stepped:.0f}s after the load step")
    assert not load.failures and not load.unreachable, (load.failures[:3], len(load.unreachable))
    eventually(lambda: len(live_pods(kube)) == 1 and scaling(kube).get("desiredReplicas") == 1, 240, interval=1,
               what="back to one pod after the window and the delay")
    events = kube("get", "events", "-o", "jsonpath={.items[*].reason}")
    assert "ScaledUp" in events and "ScaledDown" in events
    sent = load.received
    eventually(lambda: totals_match(kube, sent), 90, interval=1, what="status.usage equal to what clients received")
    assert (status(kube).get("usage") or {}).get("podsUnaccounted") == 0


def test_pods_whose_metrics_cannot_be_read_are_not_scaled_away(
        operator: ChartOperator, kube: Kubectl, frozen: list[tuple[dict[str, str], str]]) -> None:
    """Blind rounds used to read as zero load: pods that stopped answering /metrics were scaled away within
    the scale-down delay. Frozen for longer than the stable window and the delay together, two busy pods stay
    two; once they answer again and the load is gone, the service shrinks as usual, every token counted.
    Frozen pods fail their readiness probe, so the Service may have no ready endpoint for a while (until
    the pods answer again): connections refused then are the cluster's doing, and nothing was sent on them."""
    # Windows that a freeze can outlast before the liveness probe (3 x 10 s) restarts the frozen containers
    kube.apply(autoscaled(max_replicas=2, window=10, panic=4))
    eventually(lambda: ready_pods(kube) == 1, 180, interval=1, what="one ready pod")
    with Load(reachable_service(kube)) as load:
        eventually(lambda: ready_pods(kube) == 2, 240, interval=1, what="two pods ready under the load")
        froze = time.monotonic()
        for pod in live_pods(kube):
            node_ctr(kube.env, "tasks", "pause", container_id(pod))
            frozen.append((kube.env, container_id(pod)))
        blind_until = time.monotonic() + 10 + 10 + 1  # the stable window and the delay, within the liveness
        reasons = set()
        while time.monotonic() < blind_until:  # observed over the whole period, not waited for
            decided = scaling(kube)
            reasons.add(decided.get("reason"))
            assert decided.get("desiredReplicas") == 2 and len(live_pods(kube)) == 2, decided
            time.sleep(1)
        print(f"\n[autoscaling] reasons while blind: {sorted(map(str, reasons))}")
        for env, container in frozen:
            node_ctr(env, "tasks", "resume", container)
        frozen.clear()
        eventually(lambda: ready_pods(kube) == 2, 120, interval=1, what="both pods serving again")
        reachable_service(kube)
        thawed = time.monotonic()
    assert not load.failures, load.failures[:3]
    print(f"[autoscaling] connections refused while no pod was ready: {len(load.unreachable)}")
    assert all(froze <= t <= thawed for t in load.unreachable), "refused while a pod was ready"
    eventually(lambda: len(live_pods(kube)) == 1 and scaling(kube).get("desiredReplicas") == 1, 240, interval=1,
               what="back to one pod once it could see the load was gone")
    sent = load.received
    eventually(lambda: totals_match(kube, sent), 90, interval=1, what="status.usage equal to what clients received")
