"""`tally-usage`: each tenant's exact totals from the durable ledger (each service's UsageShards), without
Prometheus; with `--since`, the usage of a period: the difference from a snapshot taken at its start.

    kubectl get completionservices,usageshards -A -o json > 2026-12.json          # at the start of the period
    kubectl get completionservices,usageshards -A -o json | tally-usage --since 2026-12.json
    (a service deleted in the period is refused: what it booked after the snapshot is in neither input)
    kubectl get completionservices,usageshards -A -o json | tally-usage --tenant acme   # one tenant's lines
    kubectl get completionservices,usageshards -A -o json | tally-usage --namespace team-a --csv > usage.csv
    (services whose tenants are in UsageShards missing from the input are refused, exit 1: never an empty bill)
    kubectl get budgets,budgetshards -o json | tally-usage       # each tenant's month under each Budget

The ledger's totals only rise while a CompletionService exists, so the difference of two snapshots of one
service is exactly what it booked in between. A service deleted and created again has a new uid and a new
ledger: it is refused in a period that spans that (its earlier part is in the earlier snapshot only).
Reading is pure (`rows`, `period`); only `main` reads files and prints.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tally_operator.budget_shards import joined_status, owned

FIELDS = ("requests", "promptTokens", "completionTokens", "cachedTokens")
MAX_INPUT_BYTES = 256 << 20


class ReportError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Row:
    namespace: str
    service: str
    uid: str
    tenant: str
    counts: tuple[int, ...]  # FIELDS, in order


def rows(document: Mapping[str, Any]) -> list[Row]:
    """Every tenant line of every CompletionService in `kubectl get completionservices,usageshards -o json`
    output (a List or one object): its tenants are in its UsageShards (`other` summed over them), or in its
    status when it was written before the shards."""
    items = document.get("items") if document.get("kind", "").endswith("List") else [document]
    items = [item for item in items if isinstance(item, Mapping)] if isinstance(items, list) else []
    in_status = {str((item.get("metadata") or {}).get("uid", "")) for item in items
                 if item.get("kind") == "CompletionService"
                 and "shardKey" not in ((item.get("status") or {}).get("usage") or {})}
    summed: dict[tuple[str, str, str, str], tuple[int, ...]] = {}
    for item in items:
        meta = item.get("metadata") or {}
        if item.get("kind") == "CompletionService" and str(meta.get("uid", "")) in in_status:
            key = (str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")))
            tenants = ((item.get("status") or {}).get("usage") or {}).get("tenants") or {}
        elif item.get("kind") == "UsageShard" and _owner(meta) not in in_status:
            key = (str(meta.get("namespace", "")), str(item.get("service", "")), _owner(meta))
            tenants = (item.get("usage") or {}).get("tenants") or {}
        else:
            continue
        for tenant, counts in tenants.items() if isinstance(tenants, Mapping) else []:
            if isinstance(counts, Mapping):
                line = tuple(_count(counts.get(f)) for f in FIELDS)
                before = summed.get((*key, str(tenant)), (0,) * len(FIELDS))
                summed[(*key, str(tenant))] = tuple(a + b for a, b in zip(before, line, strict=True))
    return [Row(namespace, service, uid, tenant, counts)
            for (namespace, service, uid, tenant), counts in sorted(summed.items())]


def unread(document: Mapping[str, Any]) -> list[str]:
    """Services whose status says their tenants are in UsageShards (`tenantCount` above 0) with none of those in
    the input: `kubectl get completionservices -o json` alone, the command before the shards, read as no usage at
    all (an empty table, exit 0: a billing job written to it billed zero)."""
    items = document.get("items") if document.get("kind", "").endswith("List") else [document]
    items = [item for item in items if isinstance(item, Mapping)] if isinstance(items, list) else []
    owners = {_owner(item.get("metadata") or {}) for item in items if item.get("kind") == "UsageShard"}
    missing = []
    for item in items:
        meta, usage = item.get("metadata") or {}, (item.get("status") or {}).get("usage") or {}
        if item.get("kind") == "CompletionService" and "shardKey" in usage and _count(usage.get("tenantCount")) \
                and str(meta.get("uid", "")) not in owners:
            missing.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
    return sorted(missing)


def _owner(meta: Mapping[str, Any]) -> str:
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid", ""))
    return ""


BUDGET_FIELDS = ("budget", "spent", "held", "remaining")


@dataclass(frozen=True, slots=True)
class BudgetRow:
    budget: str
    period: str
    tenant: str
    counts: tuple[int, ...]  # BUDGET_FIELDS, in order


def budget_rows(document: Mapping[str, Any]) -> list[BudgetRow]:
    """Every tenant's month of every platform Budget in `kubectl get budgets,budgetshards -o json` output (the
    tenants are in each Budget's BudgetShards; a status written before them holds them itself)."""
    items = document.get("items") if document.get("kind", "").endswith("List") else [document]
    items = [item for item in items if isinstance(item, Mapping)] if isinstance(items, list) else []
    shards = [item for item in items if item.get("kind") == "BudgetShard"]
    found = []
    for item in items:
        if item.get("kind") != "Budget":
            continue
        uid = str((item.get("metadata") or {}).get("uid", ""))
        status = joined_status(item.get("status") or {}, owned(shards, uid))
        tenants = status.get("tenants") or {}
        for tenant, counts in sorted(tenants.items() if isinstance(tenants, Mapping) else []):
            if isinstance(counts, Mapping):
                found.append(BudgetRow(str((item.get("metadata") or {}).get("name", "")), str(status.get("period", "")),
                                       str(tenant), tuple(_count(counts.get(f)) for f in BUDGET_FIELDS)))
    return found


def period(now: Sequence[Row], start: Sequence[Row], ignore_deleted: bool = False) -> list[Row]:
    """What each tenant used between two snapshots: now minus start, per service (by uid) and tenant. A service
    in the snapshot and gone now was deleted in the period: what it booked after the snapshot is in neither, so it
    is refused (`ignore_deleted`: left out, which the caller says)."""
    earlier = {(r.namespace, r.service, r.tenant): r for r in start}
    uids = {(r.namespace, r.service): r.uid for r in start}
    gone = sorted({(r.namespace, r.service) for r in start} - {(r.namespace, r.service) for r in now})
    if gone and not ignore_deleted:
        named = ", ".join("/".join(g) for g in gone[:10]) + (", ..." if len(gone) > 10 else "")
        raise ReportError(f"{len(gone)} service(s) of the snapshot are gone ({named}): deleted in the period, what "
                          "they booked after the snapshot is in neither input. Bill them from their usage records, or "
                          "pass --ignore-deleted to leave them out")
    result = []
    for row in now:
        uid = uids.get((row.namespace, row.service))
        if uid is not None and uid != row.uid:
            raise ReportError(f"{row.namespace}/{row.service} was deleted and created again since the snapshot "
                              "(another uid): its ledger began again, so no difference is exact")
        before = earlier.get((row.namespace, row.service, row.tenant))
        base = before.counts if before is not None else (0,) * len(FIELDS)
        if any(n < b for n, b in zip(row.counts, base, strict=True)):
            raise ReportError(f"{row.namespace}/{row.service} tenant {row.tenant}: the ledger is lower than in the "
                              "snapshot: the snapshot is not an earlier one of this cluster")
        result.append(Row(row.namespace, row.service, row.uid, row.tenant,
                          tuple(n - b for n, b in zip(row.counts, base, strict=True))))
    return result


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _load(path: str) -> Mapping[str, Any]:
    raw = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1) if path == "-" else Path(path).read_bytes()
    if len(raw) > MAX_INPUT_BYTES:
        raise ReportError(f"{path}: larger than {MAX_INPUT_BYTES >> 20} MiB")
    try:
        document = json.loads(raw)
    except ValueError as err:
        raise ReportError(f"{path}: not JSON ({err}); give `kubectl get completionservices -o json` output") from None
    if not isinstance(document, Mapping):
        raise ReportError(f"{path}: not a Kubernetes object or List")
    return document


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tally-usage", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", default="-",
                        help="`kubectl get completionservices,usageshards -o json` output (default: standard input)")
    parser.add_argument("--since", metavar="SNAPSHOT", help="the same output saved at the period's start")
    parser.add_argument("--ignore-deleted", action="store_true",
                        help="with --since: leave out services deleted in the period (named on standard error)")
    parser.add_argument("--tenant", help="only this tenant's lines")
    parser.add_argument("--namespace", action="append", metavar="NS", help="only these namespaces' services "
                        "(repeatable)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    shape.add_argument("--csv", action="store_true", help="CSV with a header row instead of a table")
    args = parser.parse_args(argv)
    try:
        document = _load(args.input)
        _check_read(document, args.input)
        found, months = rows(document), budget_rows(document)
        if args.since:
            earlier = _load(args.since)
            _check_read(earlier, args.since)
            start = rows(earlier)
            found = period(found, start, args.ignore_deleted)
            left = sorted({f"{r.namespace}/{r.service}" for r in start} - {f"{r.namespace}/{r.service}" for r in found})
            if left:
                print(f"tally-usage: left out, deleted in the period: {', '.join(left)}", file=sys.stderr)
        if args.tenant is not None:
            found = [row for row in found if row.tenant == args.tenant]
            months = [month for month in months if month.tenant == args.tenant]
        if args.namespace:
            found = [row for row in found if row.namespace in args.namespace]
    except (ReportError, OSError) as err:
        print(f"tally-usage: {err}", file=sys.stderr)
        return 1
    if args.csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        if found or not months:
            out.writerow(("namespace", "service", "tenant", *FIELDS))
            out.writerows((r.namespace, r.service, r.tenant, *r.counts) for r in found)
        if months:
            out.writerow(("budgetObject", "period", "tenant", *BUDGET_FIELDS))
            out.writerows((m.budget, m.period, m.tenant, *m.counts) for m in months)
        return 0
    if args.json:
        for row in found:
            print(json.dumps({"namespace": row.namespace, "service": row.service, "tenant": row.tenant,
                              **dict(zip(FIELDS, row.counts, strict=True))}))
        for month in months:
            print(json.dumps({"budgetObject": month.budget, "period": month.period, "tenant": month.tenant,
                              **dict(zip(BUDGET_FIELDS, month.counts, strict=True))}))
        return 0
    if months and not found:  # `kubectl get budgets,budgetshards -o json`
        _print([("BUDGET", "PERIOD", "TENANT", "LIMIT", "SPENT", "HELD", "REMAINING"),
                *((m.budget, m.period, m.tenant, *map(str, m.counts)) for m in months)], 3)
        return 0
    _print([("NAMESPACE", "SERVICE", "TENANT", "REQUESTS", "PROMPT", "COMPLETION", "CACHED"),
            *((r.namespace, r.service, r.tenant, *map(str, r.counts)) for r in found)], 3)
    return 0


def _check_read(document: Mapping[str, Any], path: str) -> None:
    missing = unread(document)
    if missing:
        named = ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else "")
        raise ReportError(f"{path}: the tenants of {len(missing)} service(s) ({named}) are in their UsageShards, "
                          "which this input does not hold: give `kubectl get completionservices,usageshards -A -o "
                          "json`")


def _print(table: Sequence[tuple[str, ...]], text_columns: int) -> None:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) if i < text_columns else cell.rjust(width)
                        for i, (cell, width) in enumerate(zip(line, widths, strict=True))).rstrip())


if __name__ == "__main__":
    sys.exit(main())
