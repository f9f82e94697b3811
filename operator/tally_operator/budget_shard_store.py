"""I/O: a platform Budget's BudgetShards read and written (budget_shards.py plans what they hold).

Each write replaces one shard whole at the resourceVersion it was read at, or creates it, and records the number
of the Budget's slices it was written under; a 409 means someone wrote in between, and the round reads everything
again (budget_round.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.budget_shards import BudgetShard, owned, shard_name
from tally_operator.kube import Kube
from tally_operator.shard_store import ShardTooLarge
from tally_operator.shards import MAX_SHARD_BYTES


def read_shards(kube: Kube, uid: str) -> dict[int, BudgetShard]:
    return owned(kube.list(c.API_VERSION, c.BUDGET_SHARD_KIND, None, f"{c.LABEL_BUDGET_OWNER}={uid}"), uid)


def write_shard(kube: Kube, budget: Mapping[str, Any], index: int, slices: Mapping[str, Any], seq: int,
                resource_version: str | None) -> None:
    uid = budget["uid"]
    obj = {"apiVersion": c.API_VERSION, "kind": c.BUDGET_SHARD_KIND,
           "metadata": {"name": shard_name(uid, index),
                        "labels": {c.LABEL_BUDGET_OWNER: uid, "app.kubernetes.io/managed-by": "tally"},
                        "ownerReferences": [{"apiVersion": c.API_VERSION, "kind": c.BUDGET_KIND,
                                             "name": budget["name"], "uid": uid, "controller": True,
                                             "blockOwnerDeletion": True}],
                        **({"resourceVersion": resource_version} if resource_version else {})},
           "budget": budget["name"], "shard": index, "seq": seq,
           "tenantCount": len(slices.get("tenants") or {}), "slices": dict(slices)}
    size = len(json.dumps(obj, separators=(",", ":")))
    if size > MAX_SHARD_BYTES:
        raise ShardTooLarge(f"BudgetShard {obj['metadata']['name']} would be {size} bytes (at most {MAX_SHARD_BYTES})")
    if resource_version:
        kube.replace(obj)
    else:
        kube.create(obj)
