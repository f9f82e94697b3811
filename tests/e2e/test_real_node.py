"""The chart's operator and the CPU example as real containers on the cluster's real node.

Images built by hack/images.sh, run by containerd and the kubelet: probes against /health and /ready, the operator
with its mounted ServiceAccount (two replicas, peering), Service routing through kube-proxy, a container
killed under the kubelet and restarted by it, and a rollout, with what clients in pods received checked
against the usage the operator puts on the resource.
"""

from __future__ import annotations

import ipaddress
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kube_harness import ROOT, Kubectl, container_id, eventually, node_ctr, reachable_cluster_ip
from operator_harness import RELEASE, ChartOperator

pytestmark = pytest.mark.e2e

VERSION = "0.1.0"
NODE = "tally-node"
POD_NET = ipaddress.ip_network("198.18.1.0/24")


@pytest.fixture(scope="module")
def served(kubectl: Kubectl, operator: ChartOperator) -> Iterator[Kubectl]:
    """The CPU example, unmodified but for a 1-second scrape, Ready and UsageHealthy on the real node."""
    name = f"n-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    kube = kubectl.in_namespace(name)
    manifest = yaml.safe_load((ROOT / "crds" / "examples" / "smollm-cpu.yaml").read_text())
    manifest["spec"]["usageHealth"] = {"scrapeIntervalSeconds": 1}
    kube.apply(manifest)
    eventually(lambda: conditions(kube).get("Ready") == "True" and conditions(kube).get("UsageHealthy") == "True",
               300, interval=1, what="smollm Ready and UsageHealthy")
    yield kube
    kubectl("delete", "namespace", name, "--wait=false", check=False)


def conditions(kube: Kubectl, name: str = "smollm") -> dict[str, str]:
    status = kube.json("get", "completionservice", name).get("status") or {}
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


def usage(kube: Kubectl) -> dict[str, Any]:
    return dict((kube.json("get", "completionservice", "smollm").get("status") or {}).get("usage") or {})


def runtime_pods(kube: Kubectl) -> list[dict[str, Any]]:
    pods = kube.json("get", "pods", "-l", "serving.tally.dev/completionservice=smollm")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def run_client(kube: Kubectl, requests: int) -> list[dict[str, Any]]:
    """A Job of the client image streams `requests` completions through the Service; their usage, as received."""
    ip = reachable_cluster_ip(kube, "smollm", 8000)
    job = f"client-{uuid.uuid4().hex[:6]}"
    kube("create", "job", job, f"--image=tally-client:{VERSION}", "--",
         "tally-demo-client", f"http://{ip}:8000/v1", "--requests", str(requests))
    eventually(lambda: kube.json("get", "job", job).get("status", {}).get("succeeded") == 1
               or _failed(kube, job), 180, interval=1, what=f"client job {job}")
    logs = kube("logs", f"job/{job}")
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert len(lines) == requests, logs
    return lines


def _failed(kube: Kubectl, job: str) -> bool:
    if kube.json("get", "job", job).get("status", {}).get("failed"):
        raise AssertionError(f"client job failed: {kube('logs', f'job/{job}', check=False)}")
    return False


KEYS = ("requests", "promptTokens", "completionTokens")


def added(before: dict[str, Any], received: list[dict[str, Any]]) -> dict[str, int]:
    return {"requests": before.get("requests", 0) + len(received),
            "promptTokens": before.get("promptTokens", 0) + sum(r["prompt"] for r in received),
            "completionTokens": before.get("completionTokens", 0) + sum(r["completion"] for r in received)}


def counted_exactly(kube: Kubectl, before: dict[str, Any], received: list[dict[str, Any]]) -> dict[str, int]:
    """Wait until status.usage is `before` plus exactly what the clients received; return it."""
    total = added(before, received)
    eventually(lambda: {k: usage(kube).get(k) for k in KEYS} == total, 90, interval=0.5,
               what=f"status.usage == {total}")
    return total


def test_operator_runs_as_two_pods_of_its_image(operator: ChartOperator) -> None:
    pods = operator.ready()
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE
        assert pod["spec"]["containers"][0]["image"] == f"tally-operator:{VERSION}"
        assert pod["spec"]["serviceAccountName"] == RELEASE
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def test_runtime_pods_are_ready_by_their_health_probes(served: Kubectl) -> None:
    # Readiness is observed, not instantaneous: on a loaded node a probe can time out once (period 5 s, two
    # failures) right after the service turned Ready; both pods must be ready, started and never restarted
    def both_ready() -> list[dict[str, Any]]:
        pods = runtime_pods(served)
        states = [p["status"]["containerStatuses"][0] for p in pods]
        return pods if len(pods) == 2 and all(s["ready"] and s["started"] for s in states) else []

    pods = eventually(both_ready, 60, interval=1, what="both runtime pods ready and started")
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE
        assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_NET
        container = pod["spec"]["containers"][0]
        # alive and started by /health; ready (in the Service) by /ready: healthy and holding its first lease
        paths = {probe: container[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe",
                                                                        "livenessProbe")}
        assert paths == {"startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health"}
        status = pod["status"]["containerStatuses"][0]
        assert status["ready"] is True and status["started"] is True and status["restartCount"] == 0, status
        assert status["image"].endswith(f"tally-runtime:{VERSION}")


def test_completions_through_the_service_are_counted_exactly(served: Kubectl) -> None:
    before = usage(served)
    received = run_client(served, 6)
    assert all(r["completion"] > 0 and r["text"] for r in received)
    counted_exactly(served, before, received)


def test_a_killed_container_is_restarted_by_the_kubelet_and_nothing_is_lost(served: Kubectl) -> None:
    total = counted_exactly(served, usage(served), run_client(served, 3))
    pod = runtime_pods(served)[0]
    name = pod["metadata"]["name"]
    # The runtime's process gets SIGKILL from outside (as the kernel's OOM killer would): no drain, no final
    # read. The kubelet restarts the container, and the ledger on the pod's emptyDir carries its counters.
    node_ctr(served.env, "tasks", "kill", "--signal", "SIGKILL", container_id(pod))
    eventually(lambda: served.json("get", "pod", name)["status"]["containerStatuses"][0]["restartCount"] >= 1,
               60, what=f"{name} restarted by the kubelet")
    eventually(lambda: conditions(served).get("Ready") == "True", 120, what="Ready again")
    counted_exactly(served, total, run_client(served, 3))


def test_a_rollout_replaces_both_pods_and_keeps_every_token(served: Kubectl) -> None:
    total = counted_exactly(served, usage(served), run_client(served, 2))
    old = {p["metadata"]["name"] for p in runtime_pods(served)}
    served("patch", "completionservice", "smollm", "--type=merge", "-p",
           json.dumps({"spec": {"engine": {"maxConcurrentGenerations": 3}}}))
    eventually(lambda: (names := {p["metadata"]["name"] for p in runtime_pods(served)}) and not names & old
               and conditions(served).get("Ready") == "True", 300, interval=1, what="both pods replaced, Ready")
    counted_exactly(served, total, run_client(served, 2))
