"""PURE: spec + metadata -> the InferencePool a routed CompletionService owns, and the endpoint picker the
operator runs for it unless the spec names one (docs/DESIGN.md, "The InferencePool backend").

The pool selects the service's runtime pods (the Deployment's selector label) on the API port, where the
runtime serves the picker's gauges (`--model-server-metrics`); a service that scales to zero has its pool
switched to its activator's pods while it has no ready pod, as its Service is, so the picker sends requests
where they are held (the activator serves the same gauges: what it holds is its queue).

The picker is the Gateway API Inference Extension's EPP in pool mode: a Deployment and Service named
`<name>-epp`, and a ServiceAccount bound in the service's namespace to the chart's ClusterRole for pickers
(read pods and pools): the operator writes no Role of its own, so it can grant nothing it was not given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.desired import activator_selector, labels, network_policy_sources, owner_reference, selector_labels
from tally_operator.settings import OperatorSettings
from tally_operator.spec import Spec

Obj = dict[str, Any]


def picker_name(meta: Mapping[str, Any], spec: Spec) -> str:
    assert spec.pool is not None
    return spec.pool.picker or meta["name"] + c.PICKER_SUFFIX


def _metadata(meta: Mapping[str, Any], name: str, component: str) -> Obj:
    return {"name": name, "namespace": meta["namespace"],
            "labels": {**labels(meta["name"]), c.LABEL_COMPONENT: component},
            "ownerReferences": [owner_reference(meta)]}


def desired_inference_pool(meta: Mapping[str, Any], spec: Spec, to_activator: bool = False) -> Obj | None:
    if spec.pool is None:
        return None
    name = meta["name"]
    return {
        "apiVersion": c.POOL_API_VERSION,
        "kind": c.POOL_KIND,
        "metadata": _metadata(meta, name, "inference-pool"),
        "spec": {
            "selector": {"matchLabels": activator_selector(name) if to_activator else selector_labels(name)},
            "targetPorts": [{"number": c.RUNTIME_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": picker_name(meta, spec),
                                  "port": {"number": spec.pool.picker_port}, "failureMode": spec.pool.failure_mode},
        },
    }


def pool_routes_to_activator(pool: Mapping[str, Any] | None) -> bool:
    """Whether an InferencePool as read selects the activator's pods."""
    return (((pool or {}).get("spec") or {}).get("selector") or {}).get("matchLabels") == activator_selector(
        str(((pool or {}).get("metadata") or {}).get("name", "")))


def desired_picker(meta: Mapping[str, Any], spec: Spec, settings: OperatorSettings) -> list[Obj]:
    """The picker's ServiceAccount, RoleBinding, Deployment and Service; none when the spec names a picker."""
    if spec.pool is None or spec.pool.picker:
        return []
    name, namespace = picker_name(meta, spec), meta["namespace"]
    pod_labels = {c.LABEL_NAME: "tally-endpoint-picker", c.LABEL_INSTANCE: name, c.LABEL_COMPONENT: "endpoint-picker",
                  c.LABEL_PART_OF: "tally", c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
    selector = {c.LABEL_INSTANCE: name, c.LABEL_COMPONENT: "endpoint-picker"}
    health = {"grpc": {"port": c.PICKER_HEALTH_PORT, "service": "inference-extension"}}
    pull_secrets = settings.picker_image_pull_secrets or settings.runtime_image_pull_secrets
    container: Obj = {
        "name": "epp",
        "image": settings.picker_image,
        "args": ["--pool-name", meta["name"], "--pool-namespace", namespace,
                 "--pool-group", c.POOL_API_VERSION.split("/")[0],
                 "--grpc-port", str(c.PICKER_GRPC_PORT), "--grpc-health-port", str(c.PICKER_HEALTH_PORT),
                 "--metrics-port", str(c.PICKER_METRICS_PORT), "--metrics-endpoint-auth=false", "--tracing=false",
                 "--zap-encoder", "json"],
        "ports": [{"name": "grpc", "containerPort": c.PICKER_GRPC_PORT},
                  {"name": "grpc-health", "containerPort": c.PICKER_HEALTH_PORT},
                  {"name": "metrics", "containerPort": c.PICKER_METRICS_PORT}],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "resources": dict(settings.picker_resources),
        "readinessProbe": {**health, "periodSeconds": 2},
        "livenessProbe": {**health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(meta, name, "endpoint-picker")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _metadata(meta, name, "endpoint-picker"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": settings.picker_cluster_role},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(meta, name, "endpoint-picker"),
         "spec": {"replicas": settings.picker_replicas, "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": pod_labels},
                               "spec": {"serviceAccountName": name, "containers": [container],
                                        "securityContext": {"runAsNonRoot": True,
                                                            "seccompProfile": {"type": "RuntimeDefault"}},
                                        **({"imagePullSecrets": [{"name": n} for n in pull_secrets]}
                                           if pull_secrets else {}),
                                        "terminationGracePeriodSeconds": 130}}}},
        *picker_network_policy(meta, name, selector, settings),
        {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(meta, name, "endpoint-picker"),
         "spec": {"type": "ClusterIP", "selector": selector,
                  "ports": [{"name": "grpc-ext-proc", "port": c.PICKER_GRPC_PORT, "targetPort": "grpc",
                             "protocol": "TCP", "appProtocol": "http2"},
                            {"name": "http-metrics", "port": c.PICKER_METRICS_PORT, "targetPort": "metrics",
                             "protocol": "TCP"}]}},
    ]


def picker_network_policy(meta: Mapping[str, Any], name: str, selector: Mapping[str, str],
                          settings: OperatorSettings) -> list[Obj]:
    """With the operator's `network_policy`: the picker's ext_proc and health ports to the clients the service's
    API port admits (a gateway), its metrics to this operator and the monitoring namespace, nothing else."""
    if not settings.network_policy:
        return []
    metrics_from, api_from = network_policy_sources(settings)
    serving: Obj = {"ports": [{"port": c.PICKER_GRPC_PORT, "protocol": "TCP"},
                              {"port": c.PICKER_HEALTH_PORT, "protocol": "TCP"}]}
    if api_from is not None:
        serving = {"from": [api_from], **serving}
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": _metadata(meta, name, "endpoint-picker"),
             "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"],
                      "ingress": [{"from": metrics_from, "ports": [{"port": c.PICKER_METRICS_PORT, "protocol": "TCP"}]},
                                  serving]}}]
