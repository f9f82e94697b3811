"""The local control plane is a real one: scheduling on GPUs, loopback pod IPs, GC, RBAC tokens, helm."""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kube_harness import FAKE_NODE_TOLERATIONS, Kubectl, eventually, token_kubeconfig

pytestmark = pytest.mark.e2e


def gpu_deployment(name: str, replicas: int, gpus: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                     *FAKE_NODE_TOLERATIONS],
                     "containers": [{"name": "c", "image": "tally-runtime:dev",
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}},
    }


def pods(kube: Kubectl, app: str) -> list[dict[str, Any]]:
    return list(kube.json("get", "pods", "-l", f"app={app}")["items"])


def test_gpu_pods_run_on_fake_nodes_with_loopback_ips(kube: Kubectl) -> None:
    kube.apply(gpu_deployment("gpu", 2, 1))
    running = eventually(lambda: [p for p in pods(kube, "gpu") if p["status"].get("phase") == "Running"
                                  and p["status"].get("podIP")] if len(pods(kube, "gpu")) == 2 else [],
                         60, what="2 running pods")
    for pod in running:
        assert pod["spec"]["nodeName"].startswith("gpu-node-")
        assert ipaddress.ip_address(pod["status"]["podIP"]).is_loopback


def test_too_many_gpus_stays_pending_with_reason(kube: Kubectl) -> None:
    kube.apply(gpu_deployment("huge", 1, 9))

    def unschedulable() -> str:
        pod = pods(kube, "huge")[0]
        conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
        scheduled = conditions.get("PodScheduled", {})
        return str(scheduled.get("message", "")) if scheduled.get("reason") == "Unschedulable" else ""

    message = eventually(unschedulable, 60, what="Unschedulable condition")
    assert "nvidia.com/gpu" in message


def test_garbage_collection_deletes_children(kube: Kubectl) -> None:
    kube.apply(gpu_deployment("gc", 1, 1))
    eventually(lambda: pods(kube, "gc"), 60, what="a pod")
    kube("delete", "deployment", "gc", "--cascade=background")
    eventually(lambda: not pods(kube, "gc") and not kube.json("get", "replicasets", "-l", "app=gc")["items"],
               60, what="pods and replicasets collected")


def test_service_account_tokens_and_rbac(kube: Kubectl, namespace: str, tmp_path: Path) -> None:
    kube("create", "serviceaccount", "reader")
    kube("create", "role", "pod-reader", "--verb=get,list", "--resource=pods")
    kube("create", "rolebinding", "reader", "--role=pod-reader", f"--serviceaccount={namespace}:reader")
    token = kube("create", "token", "reader").strip()
    assert token.count(".") == 2

    as_reader = Kubectl({**kube.env, "KUBECONFIG": str(token_kubeconfig(kube, token, tmp_path / "t.kubeconfig"))},
                        namespace)

    def can(verb: str) -> str:
        return as_reader("auth", "can-i", verb, "pods", check=False).strip()

    assert eventually(lambda: can("list") == "yes", 30, what="RBAC to take effect")
    assert can("delete") == "no"


def test_helm_installs_a_chart(kube: Kubectl, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: hello\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: hello}\ndata: {release: '{{ .Release.Name }}'}\n")
    subprocess.run(["helm", "install", "hello", str(chart), "-n", namespace, "--wait", "--timeout", "60s"],
                   check=True, env=kube.env, capture_output=True, timeout=120)
    assert kube.json("get", "configmap", "hello")["data"] == {"release": "hello"}
