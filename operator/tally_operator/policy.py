"""PURE: what a CompletionService may ask for beyond a plain service, by the operator's settings.

Creating a CompletionService should grant its author no more than running a service: no host files, no
Secrets, no images the platform did not approve, no scheduling privileges. The defaults allow a PVC,
ConfigMap or emptyDir volume for the model, the operator's own runtime image, an allowed GPU resource and a
toleration of its taint, and engine-tuning environment variables that cannot load code; the chart's `policy`
values widen them (and feed the same lists to the chart's ValidatingAdmissionPolicy, which refuses such a spec
before it reaches etcd). Refusals are `SpecError`s
with a `Forbidden...` reason: the status says Ready=False and why.
"""

from __future__ import annotations

from collections.abc import Iterable

from tally_operator.settings import OperatorSettings
from tally_operator.spec import Spec, SpecError


def check_policy(spec: Spec, settings: OperatorSettings) -> None:
    if spec.model_volume:
        kinds = sorted(spec.model_volume)
        forbidden = [k for k in kinds if k not in settings.allowed_volume_types]
        if forbidden or not kinds:
            raise SpecError("ForbiddenVolume", f"spec.model.volume uses {', '.join(forbidden) or 'no source'}; "
                                               f"allowed: {', '.join(settings.allowed_volume_types)}")
    if spec.image and not image_allowed(spec.image, (settings.runtime_image, *settings.allowed_images)):
        raise SpecError("ForbiddenImage", f"spec.engine.image {spec.image!r} is not an image this operator "
                                          "runs (see the chart's policy.allowedImages)")
    if spec.gpu_resource_name not in settings.allowed_gpu_resource_names:
        raise SpecError("ForbiddenGpuResourceName", f"resources.gpuResourceName {spec.gpu_resource_name!r} is not a "
                                                    "GPU resource this operator allows (see the chart's "
                                                    "policy.allowedGpuResourceNames)")
    allowed_keys = {spec.gpu_resource_name, *settings.allowed_toleration_keys}
    for toleration in spec.tolerations:
        key = str(toleration.get("key") or "")
        if key not in allowed_keys:
            raise SpecError("ForbiddenToleration", f"spec.scheduling.tolerations may not tolerate "
                                                   f"{key or 'every taint'!r}; allowed keys: "
                                                   f"{', '.join(sorted(allowed_keys))}")
    for env in spec.env:
        name = str(env.get("name") or "")
        if not image_allowed(name, settings.allowed_env_names):
            raise SpecError("ForbiddenEnv", f"spec.engine.env may not set {name!r}: allowed are "
                                            f"{', '.join(settings.allowed_env_names) or 'none'} (the chart's "
                                            "policy.allowedEnvNames); others could make the runtime load code")
    if spec.records_url and not settings.allow_service_delivery:
        raise SpecError("ForbiddenDelivery", "spec.usageRecords.delivery is not allowed: the platform delivers every "
                                             "service's usage records (the chart's usageRecords.delivery)")
    for field, value, allowed in (("priorityClassName", spec.priority_class_name, settings.allowed_priority_classes),
                                  ("runtimeClassName", spec.runtime_class_name, settings.allowed_runtime_classes)):
        if value and value not in allowed:
            reason = f"Forbidden{field[0].upper()}{field[1:]}"
            raise SpecError(reason, f"spec.scheduling.{field} {value!r} is not allowed (allowed: "
                                    f"{', '.join(allowed) or 'none'})")


def image_allowed(image: str, allowed: Iterable[str]) -> bool:
    """Exact references (or names), or prefixes written with a trailing '*'."""
    return any(image == entry or (entry.endswith("*") and image.startswith(entry[:-1])) for entry in allowed)
