"""The chart, and its operator as pods of the operator image on the real node (two replicas, peering)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from kube_harness import ROOT, Kubectl, container_id, eventually, in_cluster, node_ctr

CHART = ROOT / "charts" / "tally-operator"
RELEASE = "tally-operator"
NAMESPACE = "tally-system"
METRICS_PORT = 9090  # the chart's default metrics.port
OPERATOR_REPLICAS = 2  # the e2e session's operator: two pods, peering
# Fast intervals, and a policy widened for what the suite needs: kwok's taint, the contract fake's image and its
# environment (FAKE_SGLANG_*; a list set here replaces the chart's, so it names the defaults the suite uses)
SUITE_SETTINGS = ("statusIntervalSeconds=1", "reconcileIntervalSeconds=3",
                  "policy.allowedTolerationKeys={kwok.x-k8s.io/node}", "policy.allowedImages={tally-runtime-fakes:*}",
                  "policy.allowedEnvNames={NCCL_DEBUG,OMP_NUM_THREADS,TZ,FAKE_SGLANG_*}",
                  "inferencePool.pickerImage=localhost/tally-epp:v1.5.0")  # built by make images


def install_chart(kubectl: Kubectl, replicas: int, *settings: str, chart: Path = CHART) -> None:
    """The chart (or another version of it), with `replicas` operator pods on the real node."""
    # The CompletionService CRD is part of the release (templates/crds.yaml), upgraded with it. A cluster left up
    # from an older run may hold one applied by kubectl: Helm takes it over, and its fields
    sets = [arg for setting in (f"replicaCount={replicas}", *settings) for arg in ("--set", setting)]
    done = subprocess.run(["helm", "upgrade", "--install", RELEASE, str(chart), "-n", NAMESPACE, "--create-namespace",
                           "--take-ownership", "--force-conflicts", *sets, "--wait", "--timeout", "180s"],
                          env=kubectl.env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        raise RuntimeError(f"helm upgrade failed: {done.stderr}")


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


class ChartOperator:
    """The chart's operator pods, and what the tests do to them: read their metrics and logs, crash them
    (SIGKILL through containerd, restarted by the kubelet), restart them as a rollout would."""

    def __init__(self, kubectl: Kubectl, replicas: int) -> None:
        self.system = kubectl.in_namespace(NAMESPACE)
        self.replicas = replicas
        self.earlier_logs: list[str] = []  # of containers the tests replaced

    def pods(self) -> list[dict[str, Any]]:
        pods = self.system.json("get", "pods", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def ready(self, deadline: float = 180) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]]:
            pods = self.pods()
            return pods if len(pods) == self.replicas and all(map(is_ready, pods)) else []

        return list(eventually(check, deadline, interval=0.5, what=f"{self.replicas} Ready operator pods"))

    def metrics(self) -> list[str]:
        """Each operator pod's /metrics (only the active peer has a service's series)."""
        with in_cluster(5) as http:
            return [http.get(f"http://{p['status']['podIP']}:{METRICS_PORT}/metrics").text
                    for p in self.pods() if p["status"].get("podIP")]

    def logs(self) -> str:
        """What every operator container the tests saw has logged, replaced ones included."""
        return "\n".join([*self.earlier_logs, self._current_logs()])

    def _current_logs(self) -> str:
        return "\n".join(self.system("logs", p["metadata"]["name"], "--tail=-1", check=False) for p in self.pods())

    def kill(self) -> dict[str, int]:
        """Every operator process SIGKILLed (a crash: no shutdown, kopf's peering records left behind);
        returns each pod's restart count before, for `restarted`."""
        self.earlier_logs.append(self._current_logs())
        restarts = {}
        for pod in self.pods():
            restarts[pod["metadata"]["name"]] = pod["status"]["containerStatuses"][0]["restartCount"]
            node_ctr(self.system.env, "tasks", "kill", "--signal", "SIGKILL", container_id(pod))
        return restarts

    def restarted(self, before: dict[str, int]) -> None:
        """Wait until the kubelet has restarted every container `kill` killed, and they are Ready."""
        def check() -> bool:
            now = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"] for p in self.pods()}
            return all(now.get(name, -1) > count for name, count in before.items())

        eventually(check, 90, what="the operator containers restarted by the kubelet")
        self.ready()

    def restart(self) -> None:
        """A rollout: new pods, each old one stopped with SIGTERM."""
        self.earlier_logs.append(self._current_logs())
        self.system("rollout", "restart", f"deployment/{RELEASE}")
        self.system("rollout", "status", f"deployment/{RELEASE}", "--timeout=110s")
        self.ready()
