"""Session fixtures for end-to-end tests: one real control plane per run, a fresh namespace per test."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kube_harness import Kubectl, cluster_down, cluster_env, cluster_is_up
from operator_harness import OperatorProcess, chart_token_kubeconfig, install_chart
from usage_harness import PodRunner, runtime_command


@pytest.fixture(scope="session")
def kube_env() -> Iterator[dict[str, str]]:
    """Reuse a cluster that is already up (and leave it up); otherwise start one and stop it afterwards."""
    was_up = cluster_is_up()
    env = cluster_env()
    yield env
    if not was_up:
        cluster_down()


@pytest.fixture(scope="session")
def kubectl(kube_env: dict[str, str]) -> Kubectl:
    return Kubectl(kube_env)


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def kube(kubectl: Kubectl, namespace: str) -> Kubectl:
    return kubectl.in_namespace(namespace)


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The chart installed (CRDs, RBAC, peering) without operator pods, and the operator running here as the
    chart's ServiceAccount, so that it can reach the loopback runtimes of hack/pod_runner.py. Module-scoped:
    the real node's tests (test_real_node.py) run the chart's own operator pods instead, never both."""
    install_chart(kubectl)
    folder = tmp_path_factory.mktemp("operator")
    process = OperatorProcess(chart_token_kubeconfig(kubectl, folder / "sa.kubeconfig"), folder / "operator.log")
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def runner(kube_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodRunner]:
    overrides: dict[str, Any] = {}

    def command_for(pod: dict[str, Any]) -> list[str] | None:
        hook = overrides.get(pod["metadata"]["namespace"])
        return hook(pod) if hook else runtime_command(pod)

    pods = PodRunner(kube_env, tmp_path_factory.mktemp("pods"), command_for=command_for)
    pods.overrides = overrides  # type: ignore[attr-defined]
    thread = threading.Thread(target=pods.run, daemon=True)
    thread.start()
    yield pods
    pods.close()
    thread.join(timeout=30)
