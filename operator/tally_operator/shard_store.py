"""I/O: a service's UsageShards read and written (shards.py says what they hold).

Only shards the service owns are read (its uid as controller, the name its index gives); anything else is
not ours, whatever its name or labels. Each write replaces one shard whole at the resourceVersion it was read
at, or creates it: a 409 means someone wrote in between, and the pass reads everything again (books.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.desired import owner_reference
from tally_operator.kube import Kube
from tally_operator.shards import MAX_SHARD_BYTES, SHARDS, Shard, join_budgets, merged, shard_name, totals_ledger
from tally_operator.usage import Ledger, controller_uid, ledger_from_status


class ShardTooLarge(RuntimeError):
    pass


def read_shards(kube: Kube, meta: Mapping[str, Any]) -> dict[int, Shard]:
    items = kube.list(c.API_VERSION, c.SHARD_KIND, meta["namespace"], f"{c.LABEL_SHARD_OWNER}={meta['uid']}")
    return owned_shards(items, meta)


def owned_shards(items: list[dict[str, Any]], meta: Mapping[str, Any]) -> dict[int, Shard]:
    """PURE: the listed objects that are this service's shards, by index."""
    shards: dict[int, Shard] = {}
    for item in items:
        index = item.get("shard")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < SHARDS:
            continue
        item_meta = item.get("metadata") or {}
        usage = item.get("usage")
        if controller_uid(item) != meta["uid"] or item_meta.get("name") != shard_name(meta["name"], index) or \
                not isinstance(usage, Mapping):
            continue
        budgets = item.get("budgets")
        shards[index] = Shard(ledger_from_status(usage), str(item_meta.get("resourceVersion")),
                              budgets if isinstance(budgets, Mapping) else {})
    return shards


def shard_object(meta: Mapping[str, Any], index: int, body: Mapping[str, Any],
                 resource_version: str | None) -> dict[str, Any]:
    """PURE: shard `index` of the service as written (`body`: its `usage` and `budgets`)."""
    tenants = (body.get("usage") or {}).get("tenants")
    return {"apiVersion": c.API_VERSION, "kind": c.SHARD_KIND,
            "metadata": {"name": shard_name(meta["name"], index), "namespace": meta["namespace"],
                         "labels": {c.LABEL_SHARD_OWNER: meta["uid"], "app.kubernetes.io/managed-by": "tally"},
                         "ownerReferences": [owner_reference(meta)],
                         **({"resourceVersion": resource_version} if resource_version else {})},
            "service": meta["name"], "shard": index,
            "tenantCount": len(tenants) if isinstance(tenants, Mapping) else 0, **body}


def write_shard(kube: Kube, meta: Mapping[str, Any], index: int, body: Mapping[str, Any],
                resource_version: str | None) -> None:
    obj = shard_object(meta, index, body, resource_version)
    size = len(json.dumps(obj, separators=(",", ":")))
    if size > MAX_SHARD_BYTES:  # never written: the bounds in shards.py keep a shard below this
        raise ShardTooLarge(f"UsageShard {obj['metadata']['name']} would be {size} bytes (at most {MAX_SHARD_BYTES})")
    if resource_version:
        kube.replace(obj)
    else:
        kube.create(obj)


def whole_ledger(kube: Kube, meta: Mapping[str, Any], usage: Mapping[str, Any]) -> Ledger:
    """The service's ledger: the status's totals and readings with its shards' tenants."""
    ledger = ledger_from_status(usage)
    if "shardKey" not in usage:  # the layout before shards: the status holds the tenants
        return ledger
    return merged(totals_ledger(ledger), {index: shard.ledger for index, shard in read_shards(kube, meta).items()})


def with_shard_budgets(service: Mapping[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """PURE: the service with its status.budgets whole: its tenants' parts joined from its shards among `items`
    (a status written before the shards holds them itself)."""
    status = dict(service.get("status") or {})
    budgets = status.get("budgets")
    if not isinstance(budgets, Mapping) or "tenants" in budgets:
        return dict(service)
    parts = [shard.budgets for shard in owned_shards(items, service.get("metadata") or {}).values()]
    return {**service, "status": {**status, "budgets": {**budgets, **join_budgets(budgets, parts)}}}
