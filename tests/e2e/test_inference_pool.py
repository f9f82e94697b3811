"""The InferencePool backend on the real node, the operator's side: a CompletionService routed through an
InferencePool while the CRD is missing says so and keeps serving; once the Gateway API Inference Extension's
CRD (v1.5.0) is installed the operator creates the pool of the service's pods and the endpoint picker's
objects (its RoleBinding accepted by RBAC and the reach policy), the pods carry the engine-type labels and
serve the picker's gauges on the API port and nothing of Tally's; routing switched off removes them.

The picker itself (the EPP image) is not run here: this node pulls no public image, so the status says the
picker is not ready, which is what it checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_harness import Kubectl, eventually, in_cluster
from operator_harness import ChartOperator
from usage_harness import service, serving_pods, status

pytestmark = pytest.mark.e2e

CRD = Path(__file__).parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
CRD_NAME = "inferencepools.inference.networking.k8s.io"


@pytest.fixture
def no_pool_crd(kubectl: Kubectl) -> Iterator[Kubectl]:
    """The cluster without the InferencePool CRD; removed again afterwards (other tests expect none)."""
    kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true")
    yield kubectl
    kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=false")


def condition(kube: Kubectl) -> dict[str, Any]:
    return next((c for c in status(kube).get("conditions") or [] if c["type"] == "InferencePoolReady"), {})


def names(kube: Kubectl, kinds: str) -> set[str]:
    return set(kube("get", kinds, "-o", "jsonpath={.items[*].metadata.name}").split())


def test_a_routed_service_gets_its_pool_and_picker_once_the_crd_is_installed(
        operator: ChartOperator, kube: Kubectl, no_pool_crd: Kubectl) -> None:
    manifest = service(replicas=1)
    manifest["spec"]["routing"] = {"inferencePool": {"enabled": True}}
    kube.apply(manifest)
    eventually(lambda: condition(kube).get("reason") == "CRDNotInstalled", 120, interval=1,
               what="InferencePoolReady=False, CRDNotInstalled")
    (pod,) = serving_pods(kube, 1)  # the service serves meanwhile
    labels = pod["metadata"]["labels"]
    assert labels["inference.networking.k8s.io/engine-type"] == labels["llm-d.ai/engine-type"] == "sglang"
    with in_cluster(10) as http:
        page = http.get(f"http://{pod['status']['podIP']}:8000/metrics").text
    assert "sglang:num_queue_reqs" in page and "sglang:cache_config_info" in page
    assert "tally_" not in page and "tenant" not in page

    no_pool_crd("apply", "--server-side", "-f", str(CRD))
    no_pool_crd("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    pool = eventually(lambda: kube.json("get", "inferencepool", "smollm"), 90, interval=1,
                      what="the InferencePool (discovery looks again within 30 s)")
    assert pool["spec"]["selector"] == {"matchLabels": {"serving.tally.dev/completionservice": "smollm"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "smollm-epp"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "CompletionService"
    eventually(lambda: {"smollm-epp"} <= names(kube, "serviceaccounts") & names(kube, "rolebindings")
               & names(kube, "deployments") & names(kube, "services"), 60, interval=1,
               what="the picker's ServiceAccount, RoleBinding, Deployment and Service")
    binding = kube.json("get", "rolebinding", "smollm-epp")
    assert binding["roleRef"]["name"] == "tally-operator-epp"
    eventually(lambda: condition(kube).get("reason") == "PickerNotReady", 60, interval=1,
               what="InferencePoolReady=False, PickerNotReady (no picker image on this node)")
    routing = status(kube).get("routing") or {}
    assert routing == {"inferencePool": "smollm", "endpointPicker": "smollm-epp", "pickerReady": False}

    kube("patch", "completionservice", "smollm", "--type=merge", "-p",
         '{"spec":{"routing":{"inferencePool":{"enabled":false}}}}')
    eventually(lambda: not names(kube, "inferencepools") and "smollm-epp" not in names(kube, "deployments")
               | names(kube, "services") | names(kube, "serviceaccounts") | names(kube, "rolebindings"), 90,
               interval=1, what="the pool and the picker removed once routing is off")
