"""Autoscaling on the real node: the CPU example grows from 1 to 3 pods under a bounded load through its
Service, shrinks back to 1 once the load stops, and status.usage equals what the clients received."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from kube_harness import Kubectl, eventually, in_cluster
from operator_harness import ChartOperator
from usage_harness import MODEL, live_pods, service, status, totals_match

pytestmark = pytest.mark.e2e

CLIENTS = 6
LOAD_SECONDS = 240  # the load stops earlier, once three pods are ready


def scaling(kube: Kubectl) -> dict[str, Any]:
    return dict(status(kube).get("autoscaling") or {})


def ready_pods(kube: Kubectl) -> int:
    return sum(1 for p in live_pods(kube) if any(c["type"] == "Ready" and c["status"] == "True"
                                                 for c in p["status"].get("conditions") or []))


class Load:
    """`CLIENTS` clients sending completions to the Service back to back until stopped (or a deadline)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.received: list[dict[str, int]] = []
        self.refused: list[httpx.Response] = []
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def client(self, i: int) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        with in_cluster(120) as http:
            while not self.stop.is_set() and time.monotonic() < deadline:
                response = http.post(self.url, json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 24,
                                                     "ignore_eos": True})
                with self.lock:
                    if response.status_code == 200:
                        usage = response.json()["usage"]
                        self.received.append({"prompt": usage["prompt_tokens"],
                                              "completion": usage["completion_tokens"]})
                    elif response.status_code == 503 and response.headers.get("retry-after"):
                        self.refused.append(response)
                    else:
                        self.failures.append(f"{response.status_code}: {response.text[:200]}")

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)


def test_the_service_grows_under_load_and_shrinks_after_with_every_token_counted(
        operator: ChartOperator, kube: Kubectl) -> None:
    manifest = service(replicas=1)
    manifest["spec"]["engine"]["maxConcurrentGenerations"] = 1  # one slot a pod: the queue is the load
    manifest["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3, "metric": "queuedRequests", "target": 1,
                                       "stableWindowSeconds": 20, "panicWindowSeconds": 6,
                                       "scaleDownDelaySeconds": 20}
    kube.apply(manifest)
    eventually(lambda: ready_pods(kube) == 1, 180, interval=1, what="one ready pod")
    ip = kube.json("get", "service", "smollm")["spec"]["clusterIP"]
    stepped = time.monotonic()
    with Load(f"http://{ip}:8000/v1/completions") as load:
        eventually(lambda: scaling(kube).get("desiredReplicas", 0) >= 2, 90, interval=1, what="a scale-up decided")
        first_new = eventually(lambda: ready_pods(kube) >= 2 and time.monotonic(), 180, interval=1,
                               what="a second pod ready")
        eventually(lambda: ready_pods(kube) == 3, 240, interval=1, what="three pods ready")
    print(f"\n[autoscaling] first new pod ready {first_new - stepped:.0f}s after the load step")
    assert not load.failures, load.failures[:3]
    eventually(lambda: len(live_pods(kube)) == 1 and scaling(kube).get("desiredReplicas") == 1, 240, interval=1,
               what="back to one pod after the window and the delay")
    events = kube("get", "events", "-o", "jsonpath={.items[*].reason}")
    assert "ScaledUp" in events and "ScaledDown" in events
    sent = load.received
    assert len(sent) > 10
    eventually(lambda: totals_match(kube, sent), 90, interval=1, what="status.usage equal to what clients received")
    assert (status(kube).get("usage") or {}).get("podsUnaccounted") == 0
