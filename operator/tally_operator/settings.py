"""Typed operator settings, read once from TALLY_OPERATOR_* environment variables.

The `allowed_*` settings are what a CompletionService may ask for beyond a plain service (spec.py checks
them; the chart's admission policy holds the same lists): each is a comma-separated list in its variable.
By default a CompletionService may mount a PVC, ConfigMap or emptyDir volume, run the operator's own runtime
image, ask for nvidia.com/gpu or amd.com/gpu and tolerate that resource's taint, and nothing more."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ALLOWED_ENV_NAMES = (
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE",
    "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY", "TZ",
)


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    runtime_image: str = "tally-runtime:0.1.0"
    runtime_image_pull_secrets: tuple[str, ...] = ()  # Secrets of each service's namespace its pods pull with
    reconcile_interval: float = 60.0  # seconds between full passes (re-apply children) per resource
    status_interval: float = 5.0  # seconds between status refreshes per resource (reads only)
    cluster_domain: str = "cluster.local"
    metrics_port: int = 9090  # 0 disables the operator's /metrics server
    metrics_address: str = "127.0.0.1"  # the chart sets 0.0.0.0 inside the pod
    workers: int = 0  # threads running handlers concurrently; 0 keeps kopf's default
    scrape_concurrency: int = 16
    scrape_timeout: float = 3.0
    peering_name: str = "tally-operator"  # the chart sets the release's full name
    peering_clusterwide: bool = True  # False for an operator that watches given namespaces
    # An image volume mounts any image the node can pull: allowed only when the chart's policy names it
    allowed_volume_types: tuple[str, ...] = ("persistentVolumeClaim", "configMap", "emptyDir")
    # resources.gpuResourceName: its taint is tolerated too, so it must be a GPU's (never a control plane's)
    allowed_gpu_resource_names: tuple[str, ...] = ("nvidia.com/gpu", "amd.com/gpu")
    allowed_images: tuple[str, ...] = ()  # beyond runtime_image; an entry ending in '*' is a prefix
    allowed_toleration_keys: tuple[str, ...] = ()  # beyond the GPU resource's own taint
    allowed_priority_classes: tuple[str, ...] = ()
    # spec.engine.env names: engine tuning that cannot make the process load code (an entry ending in '*' is a
    # prefix). PATH, OPENSSL_CONF, CC, TRITON_CACHE_DIR and their kind are doors to the author's own code
    allowed_env_names: tuple[str, ...] = ALLOWED_ENV_NAMES
    allowed_runtime_classes: tuple[str, ...] = ()
    # A NetworkPolicy per service: its metrics port open to this operator's pods only (namespace and
    # instance label below) and to `monitoring_namespace`; its API port to every client unless
    # `network_policy_api_same_namespace`
    network_policy: bool = False
    network_policy_api_same_namespace: bool = False
    namespace: str = ""  # where the operator runs (the chart sets it from the downward API)
    instance: str = "tally-operator"  # its pods' app.kubernetes.io/instance label
    # Metrics port of the runtime pods also open to this namespace's pods (a Prometheus), with network_policy
    monitoring_namespace: str = ""
    # The Ed25519 private key (PEM) that signs final-read acknowledgements (signing.py); the chart mounts it
    signing_key_file: str = ""
    final_read_key: str = ""  # its public key, put in every runtime pod's environment (set at start-up)
    # The endpoint picker the operator runs for a service routed through an InferencePool, and the ClusterRole
    # its ServiceAccount is bound to in the service's namespace (the chart creates it: read pods and pools)
    picker_image: str = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
    picker_cluster_role: str = "tally-operator-epp"
    picker_replicas: int = 1
    # its container's resources (JSON in the variable: the chart's inferencePool.pickerResources)
    picker_resources: Mapping[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}})
    picker_image_pull_secrets: tuple[str, ...] = ()  # empty: runtime_image_pull_secrets
    # Record delivery, the platform's (chart values usageRecords.*): how many undelivered bytes a pod's spool holds
    # (its volume is sized from it, so the spool never fills it), the receiver's CAs (PEM) and an egress proxy
    records_spool_bytes: int = 64 << 20
    records_ca: str = ""
    records_proxy: str = ""
    # The platform's billing system (chart values usageRecords.delivery): the operator collects every pod's
    # records and forwards them there with this token (a file of the operator's own Secret, never in a serving
    # namespace); a service's own spec.usageRecords.delivery applies instead only where this allows it
    records_url: str = ""
    records_token_file: str = ""
    allow_service_delivery: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            key = f"TALLY_OPERATOR_{f.name.upper()}"
            if key in env:
                try:
                    kind = type(getattr(cls(), f.name))
                    if kind is tuple:
                        values[f.name] = tuple(item.strip() for item in env[key].split(",") if item.strip())
                    elif kind is dict:
                        values[f.name] = _object(env[key])
                    else:
                        values[f.name] = _boolean(env[key]) if kind is bool else kind(env[key])
                except ValueError as err:
                    raise ValueError(f"{key}: {err}") from None
        return cls(**values)  # type: ignore[arg-type]


def _object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _boolean(text: str) -> bool:
    if text.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if text.strip().lower() in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")
