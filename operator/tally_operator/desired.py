"""PURE: spec + metadata -> the Deployment, Service and PodDisruptionBudget a CompletionService owns.

Each builder returns a complete object for server-side apply: fields we send are ours, fields we stop
sending are removed, manual edits to them are reverted on the next pass.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.samples import MAX_TENANTS_PER_POD
from tally_operator.settings import OperatorSettings
from tally_operator.spec import Spec
from tally_runtime.contract import READY_PATH

Obj = dict[str, Any]


def selector_labels(name: str) -> dict[str, str]:
    """Immutable: a Deployment's selector cannot change, so it holds only this."""
    return {c.LABEL_SERVICE: name}


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        c.LABEL_NAME: "tally-runtime",
        c.LABEL_INSTANCE: name,
        c.LABEL_COMPONENT: "completion-service",
        c.LABEL_PART_OF: "tally",
        c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
    }


def engine_type_labels(spec: Spec) -> dict[str, str]:
    """With an InferencePool: the engine whose gauge names the endpoint picker reads from the pods (the API
    port serves SGLang's names whatever the engine: pool_metrics.py)."""
    return {label: "sglang" for label in c.ENGINE_TYPE_LABELS} if spec.pool is not None else {}


def owner_reference(meta: Mapping[str, Any]) -> Obj:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _metadata(meta: Mapping[str, Any]) -> Obj:
    return {"name": meta["name"], "namespace": meta["namespace"], "labels": labels(meta["name"]),
            "ownerReferences": [owner_reference(meta)]}


def endpoint(meta: Mapping[str, Any], settings: OperatorSettings) -> str:
    return f"http://{meta['name']}.{meta['namespace']}.svc.{settings.cluster_domain}:{c.RUNTIME_PORT}/v1"


def final_read_seconds(spec: Spec) -> int:
    """How long a drained pod waits for the operator's last scrape: three scrape intervals and a margin
    for a busy operator (a pod that leaves unread is counted unaccounted)."""
    return 3 * spec.scrape_interval_seconds + 10


# A deleted pod leaves its Service's endpoints at once, but kube-proxy on every node takes a moment to stop
# sending it new connections: the container gets SIGTERM (and starts closing connections) only after this
# pause, so a client's reconnect lands on another pod (Kubernetes' preStop sleep action, 1.30+).
PRE_STOP_SECONDS = 5


def grace_seconds(spec: Spec) -> int:
    """The pod's terminationGracePeriodSeconds: the preStop pause, the drain, the final read, time to exit."""
    return PRE_STOP_SECONDS + spec.drain_seconds + final_read_seconds(spec) + 15


def records_collected(spec: Spec, settings: OperatorSettings) -> bool:
    """The platform delivers this service's records (the operator collects them from its pods): a billing system
    is configured, and the service does not deliver its own where the platform allows that."""
    return bool(settings.records_url) and not (spec.records_url and settings.allow_service_delivery)


def records_pushed(spec: Spec, settings: OperatorSettings) -> bool:
    """The service's pods deliver its records themselves, to its spec's receiver (where the platform allows)."""
    return bool(spec.records_url) and settings.allow_service_delivery


def has_credentials(url: str) -> bool:
    """Whether a URL carries a user or password (`http://user:secret@proxy:3128`)."""
    parts = urllib.parse.urlsplit(url)
    return parts.username is not None or parts.password is not None


def runtime_args(spec: Spec, meta: Mapping[str, Any], settings: OperatorSettings | None = None) -> list[str]:
    """`tally-runtime serve` arguments; incremental streaming is the runtime's default and not optional."""
    args = [
        "serve", "--host", "::", "--port", str(c.RUNTIME_PORT), "--metrics-port", str(c.RUNTIME_METRICS_PORT),
        "--engine", spec.engine_kind,
        "--served-model-name", spec.model_name, "--context-length", str(spec.context_length),
        "--max-concurrent-generations", str(spec.max_concurrent_generations),
        "--journal-path", c.JOURNAL_PATH, "--drain-seconds", str(spec.drain_seconds),
        "--final-read-seconds", str(final_read_seconds(spec)),
        "--service-namespace", str(meta["namespace"]), "--service-name", str(meta["name"]),
    ]
    if spec.model_path:
        args += ["--model-path", spec.model_path]
    if spec.allow_cumulative_stream:
        args.append("--allow-cumulative-stream")
    if spec.records_format == "cloudevents":
        # $(POD_NAME) is the pod's own name (downward API), expanded by the kubelet
        args += ["--usage-records-format", "cloudevents",
                 f"--usage-source=/namespaces/{meta['namespace']}/completionservices/{meta['name']}/pods/$(POD_NAME)"]
    if spec.budgets is not None:  # every tenant a pod may be sent counted apart (a tenant past it is refused)
        args += ["--budgets", "--max-tenants", str(MAX_TENANTS_PER_POD)]
    platform = settings or OperatorSettings()
    if records_collected(spec, platform):  # kept for the operator to collect and forward (collector.py)
        args += ["--usage-records-pull", f"--usage-records-spool-bytes={platform.records_spool_bytes}"]
        if spec.records_format != "cloudevents":
            args.append(f"--usage-source=/namespaces/{meta['namespace']}/completionservices/{meta['name']}"
                        "/pods/$(POD_NAME)")
    elif records_pushed(spec, platform):  # spooled next to the journal, on the pod's volume
        args += ["--usage-records-url", spec.records_url]
        if spec.records_format != "cloudevents":
            args.append(f"--usage-source=/namespaces/{meta['namespace']}/completionservices/{meta['name']}"
                        "/pods/$(POD_NAME)")
        if spec.records_token_secret:
            args += ["--usage-records-token-file", c.DELIVERY_TOKEN_FILE]
        args.append(f"--usage-records-spool-bytes={platform.records_spool_bytes}")  # the volume is sized from it
        if platform.records_proxy and not has_credentials(platform.records_proxy):
            # the platform's proxy, where it names no credentials: a pod's arguments are its team's to read
            args.append(f"--usage-records-proxy={platform.records_proxy}")
    if spec.api_keys_secret:
        args += ["--api-keys-file", c.API_KEYS_FILE]
        if spec.trust_tenant_header:
            args.append("--trust-tenant-header")
    if spec.tenant_header != "X-Tally-Tenant":
        args += ["--tenant-header", spec.tenant_header]
    if spec.engine_kind == "sglang":
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size),
                 "--data-parallel-size", str(max(1, spec.gpus // spec.tensor_parallel_size))]
        if spec.memory_fraction:
            args += ["--mem-fraction-static", str(spec.memory_fraction)]
        if spec.max_running_requests:
            args += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.pool is not None:  # a gateway's picker reads the gauges on the API port, and counts usage from
        args += ["--model-server-metrics", "--force-include-usage"]  # every response, streams included
    # One runtime flag per item, never joined: an item is one SGLang argument however it is spelled
    args += [f"--engine-arg={arg}" for arg in spec.engine_args]
    return args


def _probe(period: int, failures: int, path: str = "/health") -> Obj:
    """/health (or /ready: /health, and with budgets the first lease held) on the metrics port: its connections
    are capped apart from the API's (http_limits.py), so API clients holding every API connection cannot fail
    the kubelet's probes."""
    return {"httpGet": {"path": path, "port": c.RUNTIME_METRICS_PORT_NAME}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _container(meta: Mapping[str, Any], spec: Spec, settings: OperatorSettings) -> Obj:
    limits: Obj = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus:
        limits[spec.gpu_resource_name] = str(spec.gpus)
    mounts: list[Obj] = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "ledger", "mountPath": c.LEDGER_DIR}]
    if spec.model_volume:
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
    if spec.api_keys_secret:
        mounts.append({"name": "api-keys", "mountPath": c.AUTH_DIR, "readOnly": True})
    if records_pushed(spec, settings) and spec.records_token_secret:
        mounts.append({"name": "delivery", "mountPath": c.DELIVERY_DIR, "readOnly": True})
    return {
        "name": c.CONTAINER_NAME,
        "image": spec.image or settings.runtime_image,
        "command": [c.RUNTIME_COMMAND],
        "args": runtime_args(spec, meta, settings),
        "ports": [{"name": c.RUNTIME_PORT_NAME, "containerPort": c.RUNTIME_PORT, "protocol": "TCP"},
                  {"name": c.RUNTIME_METRICS_PORT_NAME, "containerPort": c.RUNTIME_METRICS_PORT, "protocol": "TCP"}],
        # The pod's uid goes on the runtime's /metrics, so the operator can tell it reached this very pod
        # (a pod IP is reused once a pod is gone). The root filesystem is read-only: caches go to /tmp.
        "env": [{"name": "TALLY_LOG_LEVEL", "value": "info"},
                {"name": "TALLY_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                *([{"name": "TALLY_FINAL_READ_KEY", "value": settings.final_read_key}] if settings.final_read_key
                  else []),
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "HOME", "value": "/tmp"}, {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
                *([{"name": "TALLY_USAGE_RECORDS_CA", "value": settings.records_ca}]
                  if records_pushed(spec, settings) and settings.records_ca else []),
                *[dict(e) for e in spec.env]],
        "resources": {"requests": {"cpu": spec.cpu, "memory": spec.memory}, "limits": limits},
        "volumeMounts": mounts,
        # Model loads are slow: the startup probe gets the whole budget, liveness only starts after it.
        "startupProbe": _probe(10, max(3, spec.startup_seconds // 10)),
        "readinessProbe": _probe(5, 2, READY_PATH),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "livenessProbe": _probe(10, 3),
        "securityContext": {"runAsNonRoot": True, "runAsUser": c.RUNTIME_UID, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }


def _tolerations(spec: Spec) -> list[Obj]:
    extra = [dict(t) for t in spec.tolerations]
    if spec.gpus:
        extra.insert(0, {"key": spec.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"})
    return extra


FILE_MODE = 0o444  # model files are read, never run


def models_volume(source: Mapping[str, Any]) -> Obj:
    """The spec's model volume, its files never executable: a source that sets file modes (a ConfigMap, or one a
    platform allowed) gets read-only, non-executable ones, whatever the spec asked (a 0755 ConfigMap put an
    executable of the author's on the model path)."""
    volume: Obj = {"name": "models"}
    for kind, value in source.items():
        if kind == "name":
            continue
        if isinstance(value, Mapping) and kind in ("configMap", "secret", "projected", "downwardAPI"):
            value = {**value, "defaultMode": FILE_MODE}
            if isinstance(value.get("items"), list):
                value["items"] = [{**item, "mode": FILE_MODE} if isinstance(item, Mapping) else item
                                  for item in value["items"]]
            if isinstance(value.get("sources"), list):  # projected: each source's items
                value["sources"] = [{k: ({**v, "items": [{**i, "mode": FILE_MODE} for i in v["items"]]}
                                         if isinstance(v, Mapping) and isinstance(v.get("items"), list) else v)
                                     for k, v in src.items()} if isinstance(src, Mapping) else src
                                    for src in value["sources"]]
        volume[kind] = value
    return volume


LEDGER_MIB = 16  # the journal and the usage records file, with room
SPOOL_SLACK_MIB = 2  # beyond the spool's bound: the segment being delivered and the one being written


def ledger_volume(spec: Spec, settings: OperatorSettings) -> str:
    """The pod's own volume (journal, records, delivery spool): sized from the spool's bound, so that a receiver
    that is down fills the spool (its oldest records counted lost), never the volume (the kubelet evicts a pod
    over its emptyDir limit, spool and all, at once: no drain, no final read)."""
    if not (records_pushed(spec, settings) or records_collected(spec, settings)):
        return f"{LEDGER_MIB}Mi"
    return f"{LEDGER_MIB + SPOOL_SLACK_MIB + -(-settings.records_spool_bytes // (1 << 20))}Mi"


def _pod_spec(meta: Mapping[str, Any], spec: Spec, settings: OperatorSettings) -> Obj:
    volumes: list[Obj] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shared_memory}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "ledger", "emptyDir": {"sizeLimit": ledger_volume(spec, settings)}},
    ]
    if spec.model_volume:
        volumes.append(models_volume(spec.model_volume))
    if records_pushed(spec, settings) and spec.records_token_secret:
        volumes.append({"name": "delivery", "secret": {"secretName": spec.records_token_secret, "defaultMode": 0o400,
                                                       "items": [{"key": spec.records_token_key, "path": "token"}]}})
    if spec.api_keys_secret:
        volumes.append({"name": "api-keys", "secret": {"secretName": spec.api_keys_secret, "defaultMode": 0o400,
                                                       "items": [{"key": spec.api_keys_key, "path": "api-keys"}]}})
    pod: Obj = {
        "containers": [_container(meta, spec, settings)],
        "volumes": volumes,
        "tolerations": _tolerations(spec),
        "securityContext": {"runAsNonRoot": True, "runAsUser": c.RUNTIME_UID, "fsGroup": c.RUNTIME_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
        **({"imagePullSecrets": [{"name": name} for name in settings.runtime_image_pull_secrets]}
           if settings.runtime_image_pull_secrets else {}),
        "terminationGracePeriodSeconds": grace_seconds(spec),
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod["affinity"] = dict(spec.affinity)
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        pod["runtimeClassName"] = spec.runtime_class_name
    return pod


def desired_deployment(meta: Mapping[str, Any], spec: Spec, settings: OperatorSettings) -> Obj:
    name = meta["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # Serving capacity never drops during a rollout: a new pod must be ready before an old one goes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "progressDeadlineSeconds": spec.startup_seconds + 600,
            "template": {
                "metadata": {
                    "labels": {**labels(name), **engine_type_labels(spec)},
                    "annotations": {"prometheus.io/scrape": "true",
                                    "prometheus.io/port": str(c.RUNTIME_METRICS_PORT),
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": _pod_spec(meta, spec, settings),
            },
        },
    }


def desired_service(meta: Mapping[str, Any], to_activator: bool = False) -> Obj:
    """The service's Service: its runtime pods, or while a service scaled to zero has no ready pod, its
    activator's pods (Knative's serverless Service, switched by selector)."""
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta),
        "spec": {
            "type": "ClusterIP",
            "selector": activator_selector(name) if to_activator else selector_labels(name),
            "ports": [{"name": c.RUNTIME_PORT_NAME, "port": c.RUNTIME_PORT, "targetPort": c.RUNTIME_PORT_NAME,
                       "protocol": "TCP", "appProtocol": "http"}],
        },
    }


def activator_selector(name: str) -> dict[str, str]:
    return {c.LABEL_ACTIVATOR: name}


def routes_to_activator(service: Mapping[str, Any] | None) -> bool:
    """Whether a Service as read selects the activator's pods."""
    return ((service or {}).get("spec") or {}).get("selector") == activator_selector(str(
        ((service or {}).get("metadata") or {}).get("name", "")))


def backend_url(meta: Mapping[str, Any], settings: OperatorSettings) -> str:
    return (f"http://{meta['name']}{c.BACKEND_SUFFIX}.{meta['namespace']}.svc.{settings.cluster_domain}:"
            f"{c.RUNTIME_PORT}")


def desired_backend_service(meta: Mapping[str, Any], spec: Spec) -> Obj | None:
    """With scale to zero: `<name>-pods`, the runtime pods alone (ready ones), where the activator forwards."""
    if spec.autoscaling is None or not spec.autoscaling.scales_to_zero:
        return None
    service = desired_service(meta)
    service["metadata"]["name"] = meta["name"] + c.BACKEND_SUFFIX
    return service


ACTIVATOR_BODY_BYTES = 4 << 20  # the largest request body an activator takes (413 beyond)
ACTIVATOR_BASE_MIB = 128  # the process without requests (measured: about 50 MiB) and room


def activator_memory_mib(max_held: int) -> int:
    """The activator's memory limit: it has at most `max_held` requests in hand, each with a body of at most
    ACTIVATOR_BODY_BYTES, counted twice (its chunks and their join), so no client can take it past this."""
    return ACTIVATOR_BASE_MIB + max_held * 2 * (ACTIVATOR_BODY_BYTES >> 20)


def desired_activator(meta: Mapping[str, Any], spec: Spec, settings: OperatorSettings) -> Obj | None:
    """With scale to zero: the activator Deployment (`tally-runtime activate`, the operator's runtime image:
    it runs no model, needs no GPU, no API keys and no API access)."""
    scaling = spec.autoscaling
    if scaling is None or not scaling.scales_to_zero:
        return None
    name = meta["name"]
    pod_labels = {**activator_selector(name), c.LABEL_NAME: "tally-activator", c.LABEL_INSTANCE: name,
                  c.LABEL_COMPONENT: "activator", c.LABEL_PART_OF: "tally", c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
    # Routed through a pool: at zero the pool selects these pods, and the picker reads their gauges as a pod's
    picker_flags = ["--model-server-metrics", "--served-model-name", spec.model_name] if spec.pool is not None else []
    # Readiness is what the Service switches to at zero: probed often, but patient with a busy node (two
    # activators failing a 2 s probe at once, while a model loaded beside them, left the Service empty)
    probe = {"httpGet": {"path": "/health", "port": c.RUNTIME_METRICS_PORT_NAME}, "periodSeconds": 2,
             "timeoutSeconds": 5, "failureThreshold": 5}
    container: Obj = {
        "name": "activator",
        "image": settings.runtime_image,
        "command": [c.RUNTIME_COMMAND],
        "args": ["activate", "--service", f"{meta['namespace']}/{name}", "--backend", backend_url(meta, settings),
                 "--port", str(c.RUNTIME_PORT), "--metrics-port", str(c.RUNTIME_METRICS_PORT),
                 "--max-held", str(scaling.max_held_requests), "--hold-seconds", f"{scaling.hold_seconds:g}",
                 "--max-body-bytes", str(ACTIVATOR_BODY_BYTES), *picker_flags],
        "ports": [{"name": c.RUNTIME_PORT_NAME, "containerPort": c.RUNTIME_PORT, "protocol": "TCP"},
                  {"name": c.RUNTIME_METRICS_PORT_NAME, "containerPort": c.RUNTIME_METRICS_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "50m", "memory": "96Mi"},
                      "limits": {"memory": f"{activator_memory_mib(scaling.max_held_requests)}Mi"}},
        "readinessProbe": probe,
        "livenessProbe": {**probe, "periodSeconds": 10},
        "securityContext": {"runAsNonRoot": True, "runAsUser": c.RUNTIME_UID, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_metadata(meta), "name": name + c.ACTIVATOR_SUFFIX, "labels": pod_labels},
        "spec": {
            "replicas": scaling.activator_replicas,
            "selector": {"matchLabels": activator_selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": {**pod_labels, **engine_type_labels(spec)}},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": c.RUNTIME_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "automountServiceAccountToken": False,
                    **({"imagePullSecrets": [{"name": n} for n in settings.runtime_image_pull_secrets]}
                       if settings.runtime_image_pull_secrets else {}),
                    # held requests are forwarded before it exits, as long as a pod answers by then
                    "terminationGracePeriodSeconds": 60,
                },
            },
        },
    }


def desired_pdb(meta: Mapping[str, Any], spec: Spec) -> Obj | None:
    """Only with more than one replica: a PDB on a single pod would block node drains forever."""
    if spec.replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(meta),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(meta["name"])}},
    }


def desired_network_policy(meta: Mapping[str, Any], settings: OperatorSettings) -> Obj | None:
    """With the operator's `network_policy` setting: the metrics port (usage of every tenant, the final-read
    hand-off) open only to the operator's own pods and the monitoring namespace; the API port to every
    client, or to the pods of the service's namespace only with `network_policy_api_same_namespace`."""
    if not settings.network_policy:
        return None
    metrics_from, api_from = network_policy_sources(settings)
    api: Obj = {"ports": [{"port": c.RUNTIME_PORT, "protocol": "TCP"}]}
    if api_from is not None:
        api = {"from": [api_from], **api}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(meta),
        "spec": {
            # The runtime pods and, with scale to zero, the activator's: it relays to the pods, so a client it
            # admitted would reach them past this policy
            "podSelector": {"matchLabels": policed_labels(meta["name"])},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": metrics_from, "ports": [{"port": c.RUNTIME_METRICS_PORT, "protocol": "TCP"}]},
                api,
            ],
        },
    }


def policed_labels(name: str) -> dict[str, str]:
    """What the runtime pods and the activator's pods of a service share, and no other pod the operator makes."""
    return {c.LABEL_INSTANCE: name, c.LABEL_MANAGED_BY: c.FIELD_MANAGER}


def network_policy_sources(settings: OperatorSettings) -> tuple[list[Obj], Obj | None]:
    """Who may reach a metrics port (this operator's pods, the monitoring namespace), and, with
    `network_policy_api_same_namespace`, who may reach an API port (None: every client)."""
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.namespace}},
                "podSelector": {"matchLabels": {c.LABEL_INSTANCE: settings.instance}}}
    metrics_from: list[Obj] = [operator]
    if settings.monitoring_namespace:
        metrics_from.append({"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": settings.monitoring_namespace}}})
    return metrics_from, ({"podSelector": {}} if settings.network_policy_api_same_namespace else None)
