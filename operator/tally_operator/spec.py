"""The CompletionService spec as typed data; what the schema cannot check is checked here.

`parse_spec` raises `SpecError` (a domain error, mapped at the edge in handlers.py) with a CamelCase
reason and a sentence a user can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tally_runtime.contract import OWNED_ENGINE_ARGS


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


def parse_spec(raw: Mapping[str, Any]) -> Spec:
    """Read a spec (schema defaults already applied by the API server) and check what the schema cannot."""
    model = raw.get("model") or {}
    engine = raw.get("engine") or {}
    resources = raw.get("resources") or {}
    scheduling = raw.get("scheduling") or {}
    health = raw.get("usageHealth") or {}
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
    )
    check(spec)
    return spec


def check(spec: Spec) -> None:
    owned = sorted({a.split("=", 1)[0] for a in spec.engine_args} & OWNED_ENGINE_ARGS)
    if owned:
        raise SpecError("OwnedEngineArgument",
                        f"spec.engine.args sets {', '.join(owned)}, which Tally manages; use the matching spec "
                        "field instead")
    if spec.engine_kind == "sglang" and spec.gpus % spec.tensor_parallel_size:
        raise SpecError("GPUsNotDivisible",
                        f"resources.gpus ({spec.gpus}) is not a multiple of engine.tensorParallelSize "
                        f"({spec.tensor_parallel_size})")
    if spec.engine_kind == "sglang" and not spec.model_path:
        raise SpecError("InvalidSpec", "spec.model.path is required with the sglang engine")
