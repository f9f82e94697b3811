"""PURE: a platform Budget's BudgetShards as data: which listed objects are its own, its status joined with them,
and one round planned over both (shards.split_slices says what they hold; budget_shard_store.py reads and
writes them).

Only shards the Budget owns count (its uid as controller and in the name)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tally_operator.platform import PlatformBudget
from tally_operator.shards import SHARDS, join_slices, planned_with, split_slices
from tally_operator.slices import ServiceReport, plan_slices, slices_status, state_from_budget_status
from tally_operator.usage import controller_uid


@dataclass(frozen=True, slots=True)
class BudgetShard:
    slices: Mapping[str, Any] = field(default_factory=dict)
    seq: int = 0
    resource_version: str | None = None


def shard_name(budget_uid: str, index: int) -> str:
    return f"budget-{budget_uid}-{index:02d}"


def owned(items: Iterable[Mapping[str, Any]], uid: str) -> dict[int, BudgetShard]:
    """PURE: the listed objects that are this Budget's shards, by index."""
    shards: dict[int, BudgetShard] = {}
    for item in items:
        index, seq, slices = item.get("shard"), item.get("seq"), item.get("slices")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < SHARDS:
            continue
        meta = item.get("metadata") or {}
        if controller_uid(item) != uid or meta.get("name") != shard_name(uid, index) or \
                not isinstance(slices, Mapping):
            continue
        shards[index] = BudgetShard(slices, seq if isinstance(seq, int) and not isinstance(seq, bool) else 0,
                                    str(meta.get("resourceVersion") or "") or None)
    return shards


def joined_status(status: Mapping[str, Any], shards: Mapping[int, BudgetShard]) -> dict[str, Any]:
    """PURE: the Budget's status whole (slices.py reads it so): its tenants' parts joined from its shards, and
    `seq` no later than every shard this reader has agrees with (shards.planned_with). A status written before
    the shards holds them itself."""
    if not status or "tenants" in status:
        return dict(status)
    joined = join_slices(status, [shard.slices for shard in shards.values()])
    joined["seq"] = planned_with(status, {index: shard.seq for index, shard in shards.items()})
    return joined


@dataclass(frozen=True, slots=True)
class ShardedRound:
    """One Budget round planned over its status and shards."""

    fields: dict[str, Any]  # the status's slices fields as kept (split_slices), shardSeqs included
    writes: dict[int, dict[str, Any]]  # shards whose part changed -> their new part (written under `seq`)
    whole: dict[str, Any]  # the status as planned, whole (its tenants' parts included)
    previous: dict[str, Any]  # the status it was planned on, whole
    seq: int


def plan_round(budget: PlatformBudget, kept: Mapping[str, Any], shards: Mapping[int, BudgetShard],
               reports: Mapping[str, ServiceReport], now: datetime.datetime, key: str) -> ShardedRound:
    """PURE: the slices planned on the status whole (its shards joined), numbered above any shard's (a write
    whose status did not land numbered one too: one number never stands for two contents of a shard), split
    again by tenant; only the shards whose part changed are written."""
    previous = {**joined_status(kept, shards), "seq": max([_whole(kept.get("seq")),
                                                           *(shard.seq for shard in shards.values())])}
    planned = plan_slices(budget, state_from_budget_status(previous), reports, now)
    whole = slices_status(planned)
    fields, parts = split_slices(whole, key)
    writes = {index: part for index in sorted(set(parts) | set(shards))
              if (part := parts.get(index, {})) != dict(shards[index].slices if index in shards else {})}
    # what each shard was last written under (readers compare: shards.planned_with)
    fields["shardSeqs"] = {**{str(i): shard.seq for i, shard in shards.items()},
                           **{str(i): planned.state.seq for i in writes}}
    return ShardedRound(fields, writes, whole, previous, planned.state.seq)


def _whole(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
