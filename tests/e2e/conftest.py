"""Session fixtures for end-to-end tests: one real control plane per run, a fresh namespace per test, and the
chart's operator as pods on the cluster's real node."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
from kube_harness import Kubectl, cluster_down, cluster_env, cluster_is_up, node_ctr
from operator_harness import OPERATOR_REPLICAS, SUITE_SETTINGS, ChartOperator, install_chart


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


@pytest.fixture(scope="session")
def operator(kubectl: Kubectl) -> Iterator[ChartOperator]:
    """The chart installed as a user would, its operator two pods of the operator image (peering), with fast
    status and reconcile intervals; scaled to none when the session ends."""
    install_chart(kubectl, OPERATOR_REPLICAS, *SUITE_SETTINGS)
    pods = ChartOperator(kubectl, OPERATOR_REPLICAS)
    pods.ready()
    yield pods
    install_chart(kubectl, 0)


@pytest.fixture
def frozen() -> Iterator[list[tuple[dict[str, str], str]]]:
    """Containers the test froze (cgroup freezer, through containerd); thawed whatever the outcome."""
    held: list[tuple[dict[str, str], str]] = []
    yield held
    for env, container in held:
        with contextlib.suppress(RuntimeError):  # the container is gone (pod deleted or restarted): nothing frozen
            node_ctr(env, "tasks", "resume", container)
