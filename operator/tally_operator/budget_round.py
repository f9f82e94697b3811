"""I/O: one round of a platform Budget: read the services it covers (their status says what each spent, holds
and was asked for under it), move the slices (slices.py, pure), write the Budget's status by compare-and-swap,
and once it has landed wake the services whose slices changed and say on each covered service when a tenant
crossed 80 % and 100 % of its budget. A namespace the operator may not read is named in the condition; its
services keep what they were granted (their slices stay counted)."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tally_operator import constants as c
from tally_operator.budget import WARN_AT
from tally_operator.budget_shard_store import read_shards, write_shard
from tally_operator.budget_shards import ShardedRound, plan_round
from tally_operator.conditions import Verdict, set_condition
from tally_operator.context import Context
from tally_operator.kube import KubeError
from tally_operator.platform import BudgetSpecError, PlatformBudget, covering, parse_budget
from tally_operator.shard_store import with_shard_budgets
from tally_operator.slices import ServiceReport, report_of
from tally_operator.status import without_times

log = logging.getLogger("tally_operator")
MAX_WRITES = 5


def report(service: Mapping[str, Any], budget: PlatformBudget, platform: Sequence[PlatformBudget]) -> ServiceReport:
    """PURE: a covered service as this Budget sees it: applying it, or why not."""
    meta, spec = service.get("metadata") or {}, service.get("spec") or {}
    labels = meta.get("labels") or {}
    first = covering(platform, str(meta.get("namespace")), str(meta.get("name")), labels)
    if first and first[0].uid != budget.uid:
        return report_of(service, budget.name, False, f"follows Budget {first[0].name} (the older one)")
    if not ((spec.get("auth") or {}).get("apiKeysSecret") or {}).get("name"):
        return report_of(service, budget.name, False, "TenantsNotAuthenticated: no spec.auth.apiKeysSecret")
    return report_of(service, budget.name, True, "")


def verdict(reports: Mapping[str, ServiceReport], unreadable: Sequence[str], invalid: str) -> Verdict:
    if invalid:
        return Verdict(c.READY, "False", "InvalidSpec", invalid)
    if unreadable:
        return Verdict(c.READY, "False", "NamespaceUnreadable",
                       f"The operator may not list CompletionServices in {', '.join(unreadable)}: their services "
                       "keep the slices they were granted")
    refused = sorted(f"{r.namespace}/{r.name}: {r.reason}" for r in reports.values() if not r.applied)
    if refused:
        return Verdict(c.READY, "False", "NotApplied", "; ".join(refused)[:1000])
    return Verdict(c.READY, "True", "Applied", f"{len(reports)} service(s) apply this budget")


async def budget_round(ctx: Context, name: str, platform: Sequence[PlatformBudget]) -> bool:
    """One round; False when the Budget is gone. Transient API errors leave as KubeError (the caller retries).
    The tenants' parts of the status are in the Budget's BudgetShards: read with it, written before it, each
    only when it changed (budget_shards.py plans them, budget_shard_store.py reads and writes)."""
    for _ in range(MAX_WRITES):
        obj = await asyncio.to_thread(ctx.kube.get, c.API_VERSION, c.BUDGET_KIND, name, None)
        if obj is None:
            return False
        meta, kept = obj["metadata"], obj.get("status") or {}
        shards = await asyncio.to_thread(read_shards, ctx.kube, meta["uid"])
        generation = int(meta.get("generation") or 0)
        now = datetime.datetime.now(datetime.UTC)
        planned: ShardedRound | None = None
        try:
            budget = parse_budget(obj)
        except BudgetSpecError as error:
            result = Verdict(c.READY, "False", "InvalidSpec", str(error))
            reports: dict[str, ServiceReport] = {}
        else:
            services, unreadable = await _covered(ctx, budget)
            others = [b for b in platform if b.uid != budget.uid] + [budget]
            reports = {s["metadata"]["uid"]: report(s, budget, others) for s in services}
            key = ctx.signer.derived_key(f"budget-shards/{meta['uid']}")  # as every operator of the release derives
            planned = await asyncio.to_thread(plan_round, budget, kept, shards, reports, now, key)  # off the loop
            result = verdict(reports, unreadable, "")
        fields = planned.fields if planned is not None else {}
        writes = planned.writes if planned is not None else {}
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        status = {**({k: v for k, v in kept.items() if k not in ("conditions", "observedGeneration")}
                     if not fields else {}), **fields, "observedGeneration": generation,
                  "conditions": set_condition(list(kept.get("conditions") or []), result, stamp, generation)}
        if not writes and without_times(status) == without_times(kept):
            return True
        try:
            for index, part in writes.items():
                assert planned is not None
                await asyncio.to_thread(write_shard, ctx.kube, {"name": name, "uid": meta["uid"]}, index, part,
                                        planned.seq, shards[index].resource_version if index in shards else None)
            await asyncio.to_thread(ctx.kube.replace_status, c.API_VERSION, c.BUDGET_KIND, name, None, status,
                                    str(meta["resourceVersion"]))
        except KubeError as error:
            if error.conflict:
                continue
            raise
        if planned is not None:
            _landed(ctx, name, planned.previous, planned.whole, reports)
        return True
    raise KubeError(409, f"Budget {name}'s status changed under {MAX_WRITES} writes in a row")


async def _covered(ctx: Context, budget: PlatformBudget) -> tuple[list[dict[str, Any]], list[str]]:
    services, unreadable = [], []
    for namespace in sorted(budget.namespaces):
        try:
            listed = await asyncio.to_thread(ctx.kube.list, c.API_VERSION, c.KIND, namespace, "")
        except KubeError as error:
            if error.status not in (403, 404):
                raise
            unreadable.append(namespace)
            continue
        covered = [s for s in listed if budget.covers(namespace, s["metadata"]["name"],
                                                      s["metadata"].get("labels") or {})]
        if covered:  # each service's tenants under the budget are in its UsageShards
            shards = await asyncio.to_thread(ctx.kube.list, c.API_VERSION, c.SHARD_KIND, namespace,
                                             c.LABEL_SHARD_OWNER)
            covered = [with_shard_budgets(s, shards) for s in covered]
        services += covered
    return services, unreadable


def _landed(ctx: Context, name: str, previous: Mapping[str, Any], status: Mapping[str, Any],
            reports: Mapping[str, ServiceReport]) -> None:
    """After the write: the services whose slices changed plan at once, and crossings are told where the
    serving teams look (their services' Events)."""
    before = {s.get("uid"): s.get("seq") for s in previous.get("services") or [] if isinstance(s, Mapping)}
    for entry in status.get("services") or []:
        if entry.get("applied") and before.get(entry["uid"]) != entry.get("seq"):
            ctx.wake((entry["namespace"], entry["name"]))
    if previous.get("period") != status.get("period"):
        return
    old = previous.get("tenants") or {}
    for tenant, view in (status.get("tenants") or {}).items():
        was = (old.get(tenant) or {}).get("spent", 0)
        for mark in (WARN_AT, 1.0):
            if was < mark * view["budget"] <= view["spent"]:
                message = f"Tenant {tenant} has spent {mark:.0%} of Budget {name} for {status['period']}"
                log.info(message)
                for r in reports.values():
                    if r.applied:
                        ctx.post_event(_ref(r), "Warning" if mark >= 1 else "Normal",
                                       "BudgetExhausted" if mark >= 1 else "BudgetWarning", message)


def _ref(r: ServiceReport) -> dict[str, Any]:
    """An object reference kopf.event accepts for a service known by its report."""
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": r.name, "namespace": r.namespace,
                                                                     "uid": r.uid}}
