"""The InferencePool backend, the pure parts: the pool of a routed service, the endpoint picker the operator
runs for it (bound only to the chart's picker ClusterRole), the pods' engine-type labels and runtime flags,
and the status a pass reports from what it reads (the CRD missing included)."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator import constants as c
from tally_operator.children import pool_status, route
from tally_operator.context import Context
from tally_operator.desired import desired_activator, desired_deployment, desired_service, runtime_args
from tally_operator.desired_pool import desired_inference_pool, desired_picker, pool_routes_to_activator
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer
from tally_operator.spec import SpecError, parse_spec

META = {"name": "chat", "namespace": "team", "uid": "u-1"}
BASE: dict[str, Any] = {"model": {"name": "m"}, "engine": {"kind": "cpu"}}
ROUTED = {**BASE, "routing": {"inferencePool": {}}}
SETTINGS = OperatorSettings(picker_image="epp:1.5.0", picker_cluster_role="rel-epp")


def test_the_pool_selects_the_runtime_pods_on_the_api_port_and_points_at_the_operators_picker() -> None:
    pool = desired_inference_pool(META, parse_spec(ROUTED))
    assert pool is not None
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert pool["spec"] == {"selector": {"matchLabels": {c.LABEL_SERVICE: "chat"}},
                            "targetPorts": [{"number": 8000}],
                            "endpointPickerRef": {"kind": "Service", "name": "chat-epp", "port": {"number": 9002},
                                                  "failureMode": "FailClose"}}
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pool["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.FIELD_MANAGER
    assert desired_inference_pool(META, parse_spec(BASE)) is None


def test_the_picker_is_bound_to_the_charts_cluster_role_only_and_runs_in_pool_mode() -> None:
    objects = {o["kind"]: o for o in desired_picker(META, parse_spec(ROUTED), SETTINGS)}
    assert set(objects) == {"ServiceAccount", "RoleBinding", "Deployment", "Service"}
    binding = objects["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rel-epp"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-epp", "namespace": "team"}]
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "epp:1.5.0" and pod["serviceAccountName"] == "chat-epp"
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == "chat" and args[args.index("--pool-namespace") + 1] == "team"
    assert "--endpoint-selector" not in args  # pool mode (the selector mode is broken in v1.5.0)
    assert objects["Service"]["spec"]["ports"][0]["port"] == 9002
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "u-1" for o in objects.values())
    assert all(o["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.FIELD_MANAGER for o in objects.values())


def test_the_pickers_replicas_resources_and_pull_secrets_come_from_the_charts_values() -> None:
    settings = OperatorSettings.from_env({
        "TALLY_OPERATOR_PICKER_REPLICAS": "2",
        "TALLY_OPERATOR_PICKER_RESOURCES": '{"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}',
        "TALLY_OPERATOR_RUNTIME_IMAGE_PULL_SECRETS": "regcred"})
    deployment = next(o for o in desired_picker(META, parse_spec(ROUTED), settings) if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]  # the runtime pods' secrets, by default
    own = OperatorSettings.from_env({"TALLY_OPERATOR_RUNTIME_IMAGE_PULL_SECRETS": "regcred",
                                     "TALLY_OPERATOR_PICKER_IMAGE_PULL_SECRETS": "picker-cred"})
    deployment = next(o for o in desired_picker(META, parse_spec(ROUTED), own) if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "picker-cred"}]
    with pytest.raises(ValueError, match="TALLY_OPERATOR_PICKER_RESOURCES"):
        OperatorSettings.from_env({"TALLY_OPERATOR_PICKER_RESOURCES": "[1]"})


def test_a_named_picker_is_used_as_it_is() -> None:
    spec = parse_spec({**BASE, "routing": {"inferencePool": {"endpointPicker": {"name": "shared-epp", "port": 9100},
                                                             "failureMode": "FailOpen"}}})
    pool = desired_inference_pool(META, spec)
    assert pool is not None and pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "shared-epp", "port": {"number": 9100}, "failureMode": "FailOpen"}
    assert desired_picker(META, spec, SETTINGS) == []


@pytest.mark.parametrize("pool", [{"endpointPicker": {"name": "Not_A_Name"}}, {"endpointPicker": {"name": "x",
                                  "port": 0}}, {"failureMode": "Sometimes"}])
def test_a_bad_routing_spec_is_refused(pool: dict[str, Any]) -> None:
    with pytest.raises(SpecError):
        parse_spec({**BASE, "routing": {"inferencePool": pool}})


def test_routed_pods_carry_the_engine_type_labels_and_serve_the_pickers_gauges_and_usage_on_every_stream() -> None:
    routed, plain = parse_spec(ROUTED), parse_spec(BASE)
    labels = desired_deployment(META, routed, SETTINGS)["spec"]["template"]["metadata"]["labels"]
    assert labels["inference.networking.k8s.io/engine-type"] == labels["llm-d.ai/engine-type"] == "sglang"
    assert "llm-d.ai/engine-type" not in desired_deployment(META, plain, SETTINGS)["spec"]["template"]["metadata"][
        "labels"]  # no rollout of services that are not routed
    assert {"--model-server-metrics", "--force-include-usage"} <= set(runtime_args(routed, META))
    assert "--model-server-metrics" not in runtime_args(plain, META)


class Kube:
    def __init__(self, served: bool, objects: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.served, self.objects = served, objects

    def has(self, api_version: str, kind: str) -> bool:
        return self.served

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))


def context(kube: Kube) -> Context:
    return Context(SETTINGS, kube, None, Signer.load(""))  # type: ignore[arg-type]


def picker(ready: int, owner: str = "u-1") -> dict[str, Any]:
    return {"metadata": {"ownerReferences": [{"controller": True, "uid": owner}]}, "status": {"readyReplicas": ready}}


@pytest.mark.parametrize(("served", "objects", "status", "reason"), [
    (False, {}, "False", "CRDNotInstalled"),
    (True, {}, "False", "PickerNotReady"),
    (True, {("Deployment", "chat-epp"): picker(0)}, "False", "PickerNotReady"),
    (True, {("Deployment", "chat-epp"): picker(1, owner="someone-else")}, "False", "PickerNotReady"),
    (True, {("Deployment", "chat-epp"): picker(1)}, "True", "AsExpected"),
])
def test_the_status_says_what_was_read(served: bool, objects: dict[tuple[str, str], Any], status: str,
                                       reason: str) -> None:
    fields, verdict = pool_status(context(Kube(served, objects)), META, parse_spec(ROUTED))
    assert (verdict.type, verdict.status, verdict.reason) == (c.INFERENCE_POOL_READY, status, reason)
    assert fields["inferencePool"] == "chat" and fields["pickerReady"] == (status == "True")


def test_the_gateways_fairness_id_can_name_the_tenant_and_nothing_else_can_be_named() -> None:
    keyed = {**ROUTED, "auth": {"apiKeysSecret": {"name": "tally-api-keys"}, "trustTenantHeader": True,
                                "tenantHeader": "x-gateway-inference-fairness-id"}}
    args = runtime_args(parse_spec(keyed), META)
    assert args[args.index("--tenant-header") + 1] == "x-gateway-inference-fairness-id"
    assert "--tenant-header" not in runtime_args(parse_spec(BASE), META)
    with pytest.raises(SpecError):
        parse_spec({**keyed, "auth": {**keyed["auth"], "tenantHeader": "Authorization"}})


ZERO_ROUTED = {**ROUTED, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}


def test_at_zero_the_pool_selects_the_activator_whose_pods_serve_the_pickers_gauges() -> None:
    spec = parse_spec(ZERO_ROUTED)
    at_zero, serving = desired_inference_pool(META, spec, to_activator=True), desired_inference_pool(META, spec)
    assert at_zero is not None and serving is not None
    assert at_zero["spec"]["selector"] == {"matchLabels": {c.LABEL_ACTIVATOR: "chat"}}
    assert pool_routes_to_activator(at_zero) and not pool_routes_to_activator(serving)
    assert not pool_routes_to_activator(None)
    assert {k: v for k, v in at_zero["spec"].items() if k != "selector"} == {
        k: v for k, v in serving["spec"].items() if k != "selector"}
    activator = desired_activator(META, spec, SETTINGS)
    assert activator is not None
    labels = activator["spec"]["template"]["metadata"]["labels"]
    assert labels["inference.networking.k8s.io/engine-type"] == labels["llm-d.ai/engine-type"] == "sglang"
    args = activator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-3:] == ["--model-server-metrics", "--served-model-name", "m"]
    plain = desired_activator(META, parse_spec({**BASE, "autoscaling": ZERO_ROUTED["autoscaling"]}), SETTINGS)
    assert plain is not None and "--model-server-metrics" not in plain["spec"]["template"]["spec"]["containers"][0][
        "args"] and "llm-d.ai/engine-type" not in plain["spec"]["template"]["metadata"]["labels"]


class RecordingKube(Kube):
    def __init__(self, served: bool, objects: dict[tuple[str, str], dict[str, Any]]) -> None:
        super().__init__(served, objects)
        self.applied: list[tuple[str, dict[str, Any]]] = []

    def apply(self, obj: dict[str, Any]) -> None:
        self.applied.append((obj["kind"], obj["spec"]["selector"]))
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj


def owned(obj: dict[str, Any] | None, uid: str = "u-1") -> dict[str, Any]:
    assert obj is not None
    obj["metadata"]["ownerReferences"] = [{"controller": True, "uid": uid}]
    return obj


@pytest.mark.parametrize("pool_owner", ["u-1", "someone-else"])
def test_the_pool_switches_with_the_service_and_only_when_it_points_elsewhere(pool_owner: str) -> None:
    spec = parse_spec(ZERO_ROUTED)
    kube = RecordingKube(True, {("Service", "chat"): owned(desired_service(META)),
                                ("InferencePool", "chat"): owned(desired_inference_pool(META, spec), pool_owner)})
    events: list[tuple[str, str]] = []
    ctx = Context(SETTINGS, kube, None, Signer.load(""),  # type: ignore[arg-type]
                  post_event=lambda body, kind, reason, message: events.append((reason, message)))
    route(ctx, {}, META, spec, to_activator=True)
    ours = pool_owner == "u-1"
    assert [kind for kind, _ in kube.applied] == ["Service", *(["InferencePool"] if ours else [])]
    assert all(c.LABEL_ACTIVATOR in str(selector) for _, selector in kube.applied)
    assert events == [("RoutedToActivator", f"The Service{' and the InferencePool' if ours else ''} now "
                                            f"point{'' if ours else 's'} at its activator (no ready pod)")]
    route(ctx, {}, META, spec, to_activator=True)  # already there: nothing written, no event
    assert len(kube.applied) == (2 if ours else 1) and len(events) == 1
    route(ctx, {}, META, spec, to_activator=False)
    assert [kind for kind, _ in kube.applied[-2 if ours else -1:]] == ["Service", *(["InferencePool"] if ours else [])]
    assert events[-1][0] == "RoutedToPods"
