"""Run the operator as a subprocess with a token of the chart's own ServiceAccount (so the chart's RBAC is tested)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from kube_harness import ROOT, Kubectl, eventually, token_kubeconfig
from runtime_harness import free_port, terminate

CHART = ROOT / "charts" / "tally-operator"
RELEASE = "tally-operator"
NAMESPACE = "tally-system"


def install_chart(kubectl: Kubectl, replicas: int = 0, *settings: str) -> None:
    """The chart, with `replicas` operator pods on the real node (none: the test runs its own operator)."""
    # Helm installs CRDs but never upgrades them: a cluster left up from an older run gets the current one.
    crd = ROOT / "crds" / "serving.tally.dev_completionservices.yaml"
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    sets = [arg for setting in (f"replicaCount={replicas}", *settings) for arg in ("--set", setting)]
    done = subprocess.run(["helm", "upgrade", "--install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
                           *sets, "--wait", "--timeout", "180s"],
                          env=kubectl.env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        raise RuntimeError(f"helm upgrade failed: {done.stderr}")


def chart_token_kubeconfig(kubectl: Kubectl, path: Path) -> Path:
    """Credentials of the chart's own ServiceAccount, so that the chart's RBAC is what gets tested."""
    token = kubectl("create", "token", RELEASE, "-n", NAMESPACE, "--duration=2h").strip()
    return token_kubeconfig(kubectl, token, path)


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log: Path, extra_env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.log = log
        self.port = free_port()
        self.metrics_port = free_port()
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "TALLY_OPERATOR_STATUS_INTERVAL": "1",
               "TALLY_OPERATOR_RECONCILE_INTERVAL": "3",
               "TALLY_OPERATOR_METRICS_PORT": str(self.metrics_port), **self.extra_env}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tally_operator", f"--liveness=http://127.0.0.1:{self.port}/healthz"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        eventually(self.alive, 60, what=f"operator liveness (log: {self.log})")

    def alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """No shutdown at all: what a crashed or evicted operator does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
        self.proc = None
