"""The CompletionService spec as typed data; what the schema cannot check is checked here.

`parse_spec` raises `SpecError` (a domain error, mapped at the edge in handlers.py) with a CamelCase
reason and a sentence a user can act on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tally_operator import constants as c
from tally_operator.autoscale import KV_CACHE, METRICS, SGLANG_QUEUE, Autoscaling
from tally_operator.budget import BudgetConfig, TenantBudget
from tally_runtime.contract import OWNED_ENGINE_ARGS, engine_args_pattern


class SpecError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Spec:
    model_name: str
    model_path: str = ""
    model_volume: Mapping[str, Any] | None = None
    engine_kind: str = "sglang"
    image: str = ""
    tensor_parallel_size: int = 1
    context_length: int = 8192
    memory_fraction: float = 0.0
    max_running_requests: int = 0
    max_concurrent_generations: int = 256
    allow_cumulative_stream: bool = False
    records_format: str = "tally"  # the usage records on the pods' stdout: tally | cloudevents
    engine_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    replicas: int = 1
    gpus: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str = "4"
    memory: str = "32Gi"
    shared_memory: str = "8Gi"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str = ""
    runtime_class_name: str = ""
    startup_seconds: int = 1800
    drain_seconds: int = 300
    scrape_interval_seconds: int = 15
    max_mismatch_ratio: float = 0.0
    autoscaling: Autoscaling | None = None  # None: spec.replicas (or an external HPA/KEDA on the scale subresource)
    api_keys_secret: str = ""  # a Secret of the service's namespace holding its API keys (auth.py's format)
    api_keys_key: str = "api-keys"  # the key of that Secret
    records_url: str = ""  # usageRecords.delivery: where the pods deliver their records (delivery.py)
    records_token_secret: str = ""  # a Secret of the namespace holding the receiver's bearer token
    records_token_key: str = "token"
    trust_tenant_header: bool = False
    tenant_header: str = "X-Tally-Tenant"  # or a gateway's fairness id header (TENANT_HEADERS)
    budgets: BudgetConfig | None = None  # per-tenant token budgets and rate limits (budget.py)
    pool: PoolConfig | None = None  # routing.inferencePool: picked per request by an endpoint picker


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """routing.inferencePool: the service's pods as an InferencePool, picked by an endpoint picker."""

    picker: str = ""  # an existing picker's Service in the namespace; empty: the operator runs one
    picker_port: int = 9002
    failure_mode: str = "FailClose"  # what a gateway does when the picker does not answer: FailOpen | FailClose


def parse_spec(raw: Mapping[str, Any]) -> Spec:
    """Read a spec (schema defaults already applied by the API server) and check what the schema cannot."""
    model = raw.get("model") or {}
    engine = raw.get("engine") or {}
    resources = raw.get("resources") or {}
    scheduling = raw.get("scheduling") or {}
    health = raw.get("usageHealth") or {}
    auth = raw.get("auth") or {}
    keys = auth.get("apiKeysSecret") or {}
    delivery = (raw.get("usageRecords") or {}).get("delivery") or {}
    if not model.get("name"):
        raise SpecError("InvalidSpec", "spec.model.name is required")
    spec = Spec(
        model_name=str(model["name"]),
        model_path=str(model.get("path") or ""),
        model_volume=model.get("volume"),
        engine_kind=str(engine.get("kind", "sglang")),
        image=str(engine.get("image") or ""),
        tensor_parallel_size=int(engine.get("tensorParallelSize", 1)),
        context_length=int(engine.get("contextLength", 8192)),
        memory_fraction=float(engine.get("memoryFraction", 0.0)),
        max_running_requests=int(engine.get("maxRunningRequests", 0)),
        max_concurrent_generations=int(engine.get("maxConcurrentGenerations", 256)),
        allow_cumulative_stream=bool(engine.get("allowCumulativeStream", False)),
        records_format=str((raw.get("usageRecords") or {}).get("format", "tally")),
        engine_args=tuple(str(a) for a in engine.get("args") or ()),
        env=tuple(engine.get("env") or ()),
        replicas=int(raw.get("replicas", 1)),
        gpus=int(resources.get("gpus", 1)),
        gpu_resource_name=str(resources.get("gpuResourceName", "nvidia.com/gpu")),
        cpu=str(resources.get("cpu", "4")),
        memory=str(resources.get("memory", "32Gi")),
        shared_memory=str(resources.get("sharedMemory", "8Gi")),
        node_selector=dict(scheduling.get("nodeSelector") or {}),
        tolerations=tuple(scheduling.get("tolerations") or ()),
        affinity=scheduling.get("affinity"),
        priority_class_name=str(scheduling.get("priorityClassName") or ""),
        runtime_class_name=str(scheduling.get("runtimeClassName") or ""),
        startup_seconds=int(raw.get("startupSeconds", 1800)),
        drain_seconds=int(raw.get("drainSeconds", 300)),
        scrape_interval_seconds=int(health.get("scrapeIntervalSeconds", 15)),
        max_mismatch_ratio=float(health.get("maxMismatchRatio", 0.0)),
        autoscaling=parse_autoscaling(raw.get("autoscaling")),
        api_keys_secret=str(keys.get("name") or ""),
        api_keys_key=str(keys.get("key") or "api-keys"),
        trust_tenant_header=bool(auth.get("trustTenantHeader", False)),
        tenant_header=str(auth.get("tenantHeader") or "X-Tally-Tenant"),
        budgets=parse_budgets(raw.get("budgets")),
        pool=parse_pool((raw.get("routing") or {}).get("inferencePool")),
        records_url=str(delivery.get("url") or ""),
        records_token_secret=str((delivery.get("tokenSecret") or {}).get("name") or ""),
        records_token_key=str((delivery.get("tokenSecret") or {}).get("key") or "token"),
    )
    check(spec)
    return spec


# Environment variables a service may not set: the runtime's own settings (TALLY_*: the operator passes
# those as flags, and an unset flag would fall back to them) and what changes how Python loads code.
FORBIDDEN_ENV_PREFIXES = ("TALLY_", "PYTHON", "LD_")
# Names the operator sets itself (a repeat would win: the last of a name counts), e.g. POD_NAME names the
# CloudEvents source of every usage record
RESERVED_ENV = frozenset({"POD_NAME", "HOME", "XDG_CACHE_HOME", "PATH"})
# A Secret opts in to holding a service's API keys by its name; any other Secret of the namespace stays out of
# reach of whoever may create a CompletionService (no Secret is read by the operator to check a label)
KEYS_SECRET_PREFIX = "tally-api-keys"
DELIVERY_SECRET_PREFIX = "tally-usage-delivery"  # the same opt-in for the records receiver's token


ENGINE_ARG = re.compile(engine_args_pattern())
MAX_ENGINE_ARGS = 64  # as the CRD says


def owned_flag(arg: str) -> str | None:
    """The owned argument `arg` names, also when abbreviated (argparse would take `--mem-frac` for
    `--mem-fraction-static`): named in the refusal, so the user knows which spec field to use instead."""
    flag = arg.split("=", 1)[0].strip()
    if not flag.startswith("--") or len(flag) < 4:
        return None
    return next((owned for owned in sorted(OWNED_ENGINE_ARGS) if owned.startswith(flag)), None)


def check_engine_args(args: tuple[str, ...]) -> None:
    """Each item is one allowed option by its full name (contract.ENGINE_ARG_VALUES / _SWITCHES), so nothing
    a service passes can be read by SGLang as another option, abbreviated or split on whitespace."""
    if len(args) > MAX_ENGINE_ARGS:
        raise SpecError("ForbiddenEngineArgument", f"spec.engine.args has {len(args)} items; at most {MAX_ENGINE_ARGS}")
    owned = sorted({owned for a in args if (owned := owned_flag(a))})
    if owned:
        raise SpecError("OwnedEngineArgument",
                        f"spec.engine.args sets {', '.join(owned)} (or an abbreviation of it), which Tally "
                        "manages; use the matching spec field instead")
    refused = [a for a in args if not ENGINE_ARG.fullmatch(a)]
    if refused:
        shown = ", ".join(repr(a[:64]) for a in refused[:3])
        raise SpecError("ForbiddenEngineArgument",
                        f"spec.engine.args may hold only SGLang options a service may set, one per item, by full "
                        f"name ('--name=value' or '--name'); refused: {shown}")


MAX_SCALING_WINDOW_SECONDS = 3600  # as the CRD says
MIN_TARGET, MAX_TARGET = 0.001, 1e6  # as the CRD says: a target per pod of any signal fits
MAX_RATE = 1000.0  # maxScaleUpRate, as the CRD says
MAX_GRACE_SECONDS = 86400  # scaleToZero.graceSeconds, as the CRD says


def parse_autoscaling(raw: Mapping[str, Any] | None) -> Autoscaling | None:
    if not raw or not raw.get("enabled", True):
        return None
    zero = raw.get("scaleToZero") or {}
    scaling = Autoscaling(
        min_replicas=int(raw.get("minReplicas", 1)), max_replicas=int(raw.get("maxReplicas", 1)),
        metric=str(raw.get("metric", "queuedRequests")), target=float(raw.get("target", 4)),
        stable_window_seconds=float(raw.get("stableWindowSeconds", 300)),
        panic_window_seconds=float(raw.get("panicWindowSeconds", 60)),
        scale_down_delay_seconds=float(raw.get("scaleDownDelaySeconds", 600)),
        max_scale_up_rate=float(raw.get("maxScaleUpRate", 2.0)),
        scale_to_zero_grace_seconds=float(zero.get("graceSeconds", 900)),
        hold_seconds=float(zero.get("holdSeconds", 600)),
        max_held_requests=int(zero.get("maxHeldRequests", 64)),
        activator_replicas=int(zero.get("activatorReplicas", 2)))
    if scaling.min_replicas < 0:
        raise SpecError("InvalidSpec", "spec.autoscaling.minReplicas must not be negative")
    if not (0 <= scaling.scale_to_zero_grace_seconds <= MAX_GRACE_SECONDS and 1 <= scaling.hold_seconds <= 3600
            and 1 <= scaling.max_held_requests <= MAX_HELD_REQUESTS and 1 <= scaling.activator_replicas <= 5):
        raise SpecError("InvalidSpec", "spec.autoscaling.scaleToZero: graceSeconds 0 to 86400, holdSeconds 1 to "
                                       f"3600, maxHeldRequests 1 to {MAX_HELD_REQUESTS}, activatorReplicas 1 to 5")
    if scaling.max_replicas < scaling.min_replicas:
        raise SpecError("InvalidSpec", "spec.autoscaling.maxReplicas must be at least minReplicas")
    if scaling.metric not in METRICS or not MIN_TARGET <= scaling.target <= MAX_TARGET:
        raise SpecError("InvalidSpec", f"spec.autoscaling needs a metric of {', '.join(METRICS)} and a target "
                                       f"from {MIN_TARGET:g} to {MAX_TARGET:g}")
    longest = max(scaling.stable_window_seconds, scaling.scale_down_delay_seconds)
    if longest > MAX_SCALING_WINDOW_SECONDS:  # the operator keeps a sample per scrape over these windows
        raise SpecError("InvalidSpec", f"spec.autoscaling: windows and the scale-down delay are at most "
                                       f"{MAX_SCALING_WINDOW_SECONDS} s (Knative's bound too)")
    if scaling.panic_window_seconds > scaling.stable_window_seconds or not 1 < scaling.max_scale_up_rate <= MAX_RATE:
        raise SpecError("InvalidSpec", "spec.autoscaling: the panic window must not exceed the stable window, and "
                                       f"maxScaleUpRate must be above 1 and at most {MAX_RATE:g}")
    if min(scaling.stable_window_seconds, scaling.panic_window_seconds, scaling.scale_down_delay_seconds) < 0:
        raise SpecError("InvalidSpec", "spec.autoscaling: windows and the scale-down delay must not be negative")
    return scaling


# Each request an activator has in hand holds its body (at most 4 MiB) in the activator's memory, which the
# operator sizes from this count (desired.activator_memory_mib): 256 of them is a 2.2 GiB limit
MAX_HELD_REQUESTS = 256
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str, spec: Spec) -> None:
    """The service's name leaves room for the longest child name it makes where a DNS label (63 characters) is
    required: the scale-to-zero backend Service `<name>-pods`, the picker's Service and pod label `<name>-epp`
    (the CRD holds the same rule). A name the API server refuses on one child would stop every pass there."""
    children = [name]
    if spec.autoscaling is not None and spec.autoscaling.scales_to_zero:
        children.append(name + c.BACKEND_SUFFIX)
    if spec.pool is not None and not spec.pool.picker:
        children.append(name + c.PICKER_SUFFIX)
    longest = max(children, key=len)
    if len(longest) > 63:
        raise SpecError("NameTooLong", f"The name makes the child name {longest!r}, {len(longest)} characters; "
                                       f"names are DNS labels of at most 63: shorten the service's name to "
                                       f"{63 - (len(longest) - len(name))} characters")


def parse_pool(raw: Mapping[str, Any] | None) -> PoolConfig | None:
    if raw is None or not raw.get("enabled", True):
        return None
    picker = raw.get("endpointPicker") or {}
    pool = PoolConfig(picker=str(picker.get("name") or ""), picker_port=int(picker.get("port", 9002)),
                      failure_mode=str(raw.get("failureMode", "FailClose")))
    if pool.picker and (len(pool.picker) > 63 or not DNS_LABEL.match(pool.picker)):
        raise SpecError("InvalidSpec", "spec.routing.inferencePool.endpointPicker.name must name a Service "
                                       "(a DNS label)")
    if not 0 < pool.picker_port < 65536 or pool.failure_mode not in ("FailOpen", "FailClose"):
        raise SpecError("InvalidSpec", "spec.routing.inferencePool: endpointPicker.port 1-65535, failureMode FailOpen "
                                       "or FailClose")
    return pool


# The headers a tenant may be named by: Tally's, and the fairness ids of the Inference Extension and llm-d
TENANT_HEADERS = ("X-Tally-Tenant", "x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")


def check(spec: Spec) -> None:
    if spec.autoscaling and spec.autoscaling.metric in {SGLANG_QUEUE, KV_CACHE} and spec.engine_kind != "sglang":
        raise SpecError("InvalidSpec", f"spec.autoscaling.metric {spec.autoscaling.metric} is SGLang's own: the "
                                       f"{spec.engine_kind} engine does not report it")
    check_engine_args(spec.engine_args)
    if spec.tenant_header not in TENANT_HEADERS:
        raise SpecError("InvalidSpec", f"spec.auth.tenantHeader must be one of {', '.join(TENANT_HEADERS)}")
    for env in spec.env:
        name = str(env.get("name") or "")
        if "valueFrom" in env:
            raise SpecError("ForbiddenEnv", f"spec.engine.env {name!r} uses valueFrom: only literal values are "
                                            "allowed (a CompletionService may not read Secrets or the pod's fields)")
        if name.upper().startswith(FORBIDDEN_ENV_PREFIXES) or name in RESERVED_ENV:
            reserved = ", ".join(sorted(RESERVED_ENV))
            raise SpecError("ForbiddenEnv", f"spec.engine.env may not set {name!r}: names starting with "
                                            f"{', '.join(FORBIDDEN_ENV_PREFIXES)} and {reserved} are the runtime's own")
    token = spec.records_token_secret
    if token and not (token == DELIVERY_SECRET_PREFIX or token.startswith(DELIVERY_SECRET_PREFIX + "-")):
        raise SpecError("ForbiddenSecret", f"spec.usageRecords.delivery.tokenSecret.name must be "
                                           f"{DELIVERY_SECRET_PREFIX} or start with {DELIVERY_SECRET_PREFIX}-")
    if spec.records_url and not re.match(r"^https?://\S+$", spec.records_url):
        raise SpecError("InvalidSpec", "spec.usageRecords.delivery.url must be an http(s) URL")
    secret = spec.api_keys_secret
    if secret and not (secret == KEYS_SECRET_PREFIX or secret.startswith(KEYS_SECRET_PREFIX + "-")):
        raise SpecError("ForbiddenSecret", f"spec.auth.apiKeysSecret.name must be {KEYS_SECRET_PREFIX} or start with "
                                           f"{KEYS_SECRET_PREFIX}-: a Secret opts in to holding API keys by its name")
    if spec.engine_kind == "sglang" and spec.gpus % spec.tensor_parallel_size:
        raise SpecError("GPUsNotDivisible",
                        f"resources.gpus ({spec.gpus}) is not a multiple of engine.tensorParallelSize "
                        f"({spec.tensor_parallel_size})")
    if spec.engine_kind == "sglang" and not spec.model_path:
        raise SpecError("InvalidSpec", "spec.model.path is required with the sglang engine")


MAX_BUDGET_TENANTS = 100  # as the CRD says


def parse_budgets(raw: Any) -> BudgetConfig | None:
    """spec.budgets (the schema checked the shapes; this checks what it cannot, for a spec read without it)."""
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise SpecError("InvalidSpec", "spec.budgets must be an object")

    def one(item: Any, where: str) -> TenantBudget:
        if not isinstance(item, Mapping):
            raise SpecError("InvalidSpec", f"{where} must be an object")
        values = []
        for key in ("monthlyTokens", "tokensPerMinute"):
            value = item.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0
                                      or value > 2**53):
                raise SpecError("InvalidSpec", f"{where}.{key} must be a whole number of tokens, 0 to 2^53")
            values.append(value)
        return TenantBudget(values[0], values[1])

    count = raw.get("count", "total")
    if count not in ("total", "completion", "prompt"):
        raise SpecError("InvalidSpec", "spec.budgets.count must be total, completion or prompt")
    tenants: dict[str, TenantBudget] = {}
    listed = raw.get("tenants") or []
    if not isinstance(listed, list) or len(listed) > MAX_BUDGET_TENANTS:
        raise SpecError("InvalidSpec", f"spec.budgets.tenants must be a list of at most {MAX_BUDGET_TENANTS}")
    for i, item in enumerate(listed):
        name = item.get("name") if isinstance(item, Mapping) else None
        if not isinstance(name, str) or not name or name in tenants:
            raise SpecError("InvalidSpec", f"spec.budgets.tenants[{i}].name must be a tenant named once")
        tenants[name] = one(item, f"spec.budgets.tenants[{i}]")
    default = one(raw["default"], "spec.budgets.default") if raw.get("default") is not None else None
    return BudgetConfig(str(count), default, tenants)
