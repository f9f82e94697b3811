"""A service's children: apply them (server-side apply, one field manager), delete the ones no longer wanted,
never touch an object this CompletionService does not control, and read back the Deployment and the pods it
owns; the InferencePool and its picker; where the Service points (the pods, or the activator at zero)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.conditions import Verdict
from tally_operator.context import Context
from tally_operator.desired import (
    desired_activator,
    desired_backend_service,
    desired_deployment,
    desired_network_policy,
    desired_pdb,
    desired_service,
    routes_to_activator,
)
from tally_operator.desired_pool import (
    desired_inference_pool,
    desired_picker,
    picker_name,
    pool_routes_to_activator,
)
from tally_operator.kube import KubeError
from tally_operator.spec import Spec, SpecError
from tally_operator.usage import (
    controller_uid,
    owned_pods,
)

log = logging.getLogger("tally_operator")


def read_children(ctx: Context, meta: Mapping[str, str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The Deployment and the pods this CompletionService owns (through its Deployment's ReplicaSets)."""
    selector = f"{c.LABEL_SERVICE}={meta['name']}"
    deployment = ctx.kube.get("apps/v1", "Deployment", meta["name"], meta["namespace"])
    if deployment is not None and controller_uid(deployment) != meta["uid"]:  # someone else's namesake: not ours
        raise SpecError("NameConflict", f"A Deployment named {meta['name']} already exists and is not this "
                                        "CompletionService's; it is left alone: delete or rename it")
    replica_sets = ctx.kube.list("apps/v1", "ReplicaSet", meta["namespace"], selector)
    pods = ctx.kube.pods(meta["namespace"], selector)
    return deployment, [dict(p) for p in owned_pods(pods, replica_sets, deployment, meta["uid"])]

def rejected(error: KubeError) -> SpecError:
    """A non-transient API refusal: our RBAC (403) or a child the server finds invalid (400/422)."""
    reason = "Forbidden" if error.status == 403 else "InvalidChild"
    return SpecError(reason, f"The API server refused a child object: {error.message}")

def apply_all(ctx: Context, meta: dict[str, str], spec: Spec, was_routed: bool = False) -> None:
    """Apply every child; a child this service does not need is deleted. Only objects this CompletionService
    controls are ever written or deleted: a same-named object of someone else's is left alone, and the
    pass stops with `NameConflict` (the status and an Event say so)."""
    name = meta["name"]
    zero = spec.autoscaling is not None and spec.autoscaling.scales_to_zero
    children: list[tuple[str, str, str, dict[str, Any] | None]] = [
        ("apps/v1", "Deployment", name, desired_deployment(meta, spec, ctx.settings)),
        ("v1", "Service", name, None),  # below: where it points is decided by the pods' readiness (route)
        ("policy/v1", "PodDisruptionBudget", name, desired_pdb(meta, spec)),
        ("networking.k8s.io/v1", "NetworkPolicy", name, desired_network_policy(meta, ctx.settings)),
        ("apps/v1", "Deployment", name + c.ACTIVATOR_SUFFIX, desired_activator(meta, spec, ctx.settings)),
        ("v1", "Service", name + c.BACKEND_SUFFIX, desired_backend_service(meta, spec)),
    ]
    to_activator = False
    for api_version, kind, child, desired in children:
        if desired is None and kind == "NetworkPolicy" and not ctx.settings.network_policy:
            continue  # never managed here: nothing to look for (and no RBAC to look with)
        if kind == "Service" and child == name:
            to_activator = zero and routes_to_activator(ctx.kube.get(api_version, kind, child, meta["namespace"]))
            desired = desired_service(meta, to_activator=to_activator)
        apply_child(ctx, meta, api_version, kind, child, desired)
    if spec.pool is not None or was_routed:
        apply_pool(ctx, meta, spec, to_activator)  # the pool points where the Service does

def apply_child(ctx: Context, meta: Mapping[str, str], api_version: str, kind: str, child: str,
                desired: dict[str, Any] | None) -> None:
    """Apply one child, or delete it when not wanted; never one this CompletionService does not control."""
    existing = ctx.kube.get(api_version, kind, child, meta["namespace"])
    if existing is not None and controller_uid(existing) != meta["uid"]:
        raise SpecError("NameConflict", f"A {kind} named {child} already exists and is not this "
                                        f"CompletionService's; it is left alone: delete or rename it")
    if desired is not None:
        ctx.kube.apply(desired)
    elif existing is not None:
        ctx.kube.delete(api_version, kind, child, meta["namespace"], uid=existing["metadata"]["uid"])

PICKER_KINDS = (("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("apps/v1", "Deployment"),
                ("networking.k8s.io/v1", "NetworkPolicy"), ("v1", "Service"))

def apply_pool(ctx: Context, meta: Mapping[str, str], spec: Spec, to_activator: bool = False) -> None:
    """The InferencePool and the picker the operator runs for it, only where the pool's CRD is installed
    (pool_status says so otherwise); both deleted once the service is no longer routed or names its own
    picker."""
    served = ctx.kube.has(c.POOL_API_VERSION, c.POOL_KIND)
    if served:
        apply_child(ctx, meta, c.POOL_API_VERSION, c.POOL_KIND, meta["name"],
                    desired_inference_pool(meta, spec, to_activator))
    # A picker without its pool's kind would only fail: it waits for the CRD as the pool does
    wanted = {(o["apiVersion"], o["kind"]): o for o in desired_picker(meta, spec, ctx.settings)} if served else {}
    for api_version, kind in PICKER_KINDS:
        if kind == "NetworkPolicy" and not ctx.settings.network_policy:
            continue  # never managed here: nothing to look for (and no RBAC to look with)
        apply_child(ctx, meta, api_version, kind, meta["name"] + c.PICKER_SUFFIX, wanted.get((api_version, kind)))

def pool_status(ctx: Context, meta: Mapping[str, str], spec: Spec) -> tuple[dict[str, Any], Verdict]:
    """status.routing and the InferencePoolReady condition of a routed service."""
    assert spec.pool is not None
    picker = picker_name(meta, spec)
    fields: dict[str, Any] = {"inferencePool": meta["name"], "endpointPicker": picker, "pickerReady": False}
    if not ctx.kube.has(c.POOL_API_VERSION, c.POOL_KIND):
        return fields, Verdict(c.INFERENCE_POOL_READY, "False", "CRDNotInstalled",
                               f"The InferencePool CRD ({c.POOL_API_VERSION}) is not installed: install the Gateway "
                               "API Inference Extension's CRDs. The Service serves meanwhile")
    if spec.pool.picker:
        found = ctx.kube.get("v1", "Service", picker, meta["namespace"]) is not None
        fields["pickerReady"] = found
        return fields, Verdict(c.INFERENCE_POOL_READY, "True" if found else "False",
                               "PickerNamed" if found else "PickerNotFound",
                               f"InferencePool {meta['name']} points at the endpoint picker Service {picker}"
                               + ("" if found else ", which does not exist"))
    deployment = ctx.kube.get("apps/v1", "Deployment", picker, meta["namespace"])
    ready = bool(deployment and controller_uid(deployment) == meta["uid"]
                 and int((deployment.get("status") or {}).get("readyReplicas") or 0) > 0)
    fields["pickerReady"] = ready
    if ready:
        return fields, Verdict(c.INFERENCE_POOL_READY, "True", "AsExpected",
                               f"InferencePool {meta['name']} and its endpoint picker {picker} are ready")
    return fields, Verdict(c.INFERENCE_POOL_READY, "False", "PickerNotReady",
                           f"The endpoint picker {picker} has no ready pod ({ctx.settings.picker_image})")

def route(ctx: Context, body: Any, meta: Mapping[str, str], spec: Spec, to_activator: bool) -> None:
    """Point a service that scales to zero at its activator (no ready pod) or back at its pods: its Service
    and, when routed through one, its InferencePool (each only if it is ours and points elsewhere)."""
    switched = []
    service = ctx.kube.get("v1", "Service", meta["name"], meta["namespace"])
    if service is not None and controller_uid(service) == meta["uid"] and \
            routes_to_activator(service) != to_activator:
        ctx.kube.apply(desired_service(dict(meta), to_activator=to_activator))
        switched.append("Service")
    desired_pool = desired_inference_pool(meta, spec, to_activator)
    if desired_pool is not None and ctx.kube.has(c.POOL_API_VERSION, c.POOL_KIND):
        pool = ctx.kube.get(c.POOL_API_VERSION, c.POOL_KIND, meta["name"], meta["namespace"])
        if pool is not None and controller_uid(pool) == meta["uid"] and \
                pool_routes_to_activator(pool) != to_activator:
            ctx.kube.apply(desired_pool)
            switched.append("InferencePool")
    if not switched:
        return
    where = "its activator (no ready pod)" if to_activator else "its pods"
    what = f"The {' and the '.join(switched)} now point{'s' if len(switched) == 1 else ''} at {where}"
    log.info("%s/%s: %s", meta["namespace"], meta["name"], what)
    ctx.post_event(body, "Normal", "RoutedToActivator" if to_activator else "RoutedToPods", what)
