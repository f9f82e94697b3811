"""I/O: a service's UsageShards read and written (shards.py says what they hold).

Only shards the service owns are read (its uid as controller, the name its index and uid give, or the name
shards had before the uid was in it); anything else is not ours, whatever its name or labels, and a name an
object not ours holds is reported, never adopted (`ShardNameTaken`). Each write replaces one shard whole at the
resourceVersion it was read at, or creates it: a 409 means someone wrote in between, and the pass reads
everything again (books.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.desired import owner_reference
from tally_operator.kube import Kube, KubeError
from tally_operator.shards import (
    MAX_SHARD_BYTES,
    SHARDS,
    Shard,
    join_budgets,
    legacy_shard_name,
    merged,
    shard_bytes,
    shard_name,
    totals_ledger,
)
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
        name = item_meta.get("name")
        if controller_uid(item) != meta["uid"] or not isinstance(usage, Mapping) or \
                name not in (shard_name(meta["name"], meta["uid"], index), legacy_shard_name(meta["name"], index)):
            continue
        budgets = item.get("budgets")
        shards[index] = Shard(ledger_from_status(usage), str(item_meta.get("resourceVersion")),
                              budgets if isinstance(budgets, Mapping) else {}, str(name), shard_bytes(item))
    return shards


def shard_object(meta: Mapping[str, Any], index: int, body: Mapping[str, Any], read: Shard | None) -> dict[str, Any]:
    """PURE: shard `index` of the service as written (`body`: its `usage` and `budgets`) over `read`, the shard
    as read (None: created, under the name with the service's uid)."""
    tenants = (body.get("usage") or {}).get("tenants")
    name = read.name if read is not None and read.name else shard_name(meta["name"], meta["uid"], index)
    resource_version = read.resource_version if read is not None else None
    return {"apiVersion": c.API_VERSION, "kind": c.SHARD_KIND,
            "metadata": {"name": name, "namespace": meta["namespace"],
                         "labels": {c.LABEL_SHARD_OWNER: meta["uid"], "app.kubernetes.io/managed-by": "tally"},
                         "ownerReferences": [owner_reference(meta)],
                         **({"resourceVersion": resource_version} if resource_version else {})},
            "service": meta["name"], "shard": index,
            "tenantCount": len(tenants) if isinstance(tenants, Mapping) else 0, **body}


class ShardNameTaken(RuntimeError):
    """The name this service's shard is created under holds an object that is not this service's."""


def write_shard(kube: Kube, meta: Mapping[str, Any], index: int, body: Mapping[str, Any], read: Shard | None) -> None:
    """Replace the shard at the resourceVersion it was read at, or create it: a 409 (`KubeError`) means someone
    wrote in between, unless the name is taken by an object that is not ours (`ShardNameTaken`)."""
    obj = shard_object(meta, index, body, read)
    size = shard_bytes(obj)
    if size > MAX_SHARD_BYTES:  # never reached: bookkeeping.plan leaves out what would make a shard this large
        raise ShardTooLarge(f"UsageShard {obj['metadata']['name']} would be {size} bytes (at most {MAX_SHARD_BYTES})")
    if read is not None and read.resource_version:
        kube.replace(obj)
        return
    try:
        kube.create(obj)
    except KubeError as error:
        if not error.conflict:
            raise
        there = kube.get(c.API_VERSION, c.SHARD_KIND, obj["metadata"]["name"], meta["namespace"])
        if there is not None and controller_uid(there) != meta["uid"]:
            raise ShardNameTaken(f"UsageShard {obj['metadata']['name']} exists and is not this service's") from error
        raise


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
