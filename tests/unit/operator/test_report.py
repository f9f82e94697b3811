"""`tally-usage`: per-tenant totals from the ledger and the usage of a period between two snapshots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tally_operator.report import ReportError, main, period, rows


def service(uid: str, tenants: dict[str, tuple[int, int, int, int]], name: str = "chat") -> dict[str, Any]:
    return {"apiVersion": "serving.tally.dev/v1alpha1", "kind": "CompletionService",
            "metadata": {"namespace": "team", "name": name, "uid": uid},
            "status": {"usage": {"tenants": {t: dict(zip(("requests", "promptTokens", "completionTokens",
                                                           "cachedTokens"), c, strict=True))
                                             for t, c in tenants.items()}}}}


def listing(*items: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}


def test_the_usage_of_a_period_is_the_difference_of_two_snapshots() -> None:
    start = rows(listing(service("u1", {"acme": (10, 100, 200, 5)})))
    now = rows(listing(service("u1", {"acme": (15, 160, 290, 5), "zeta": (1, 2, 3, 0)})))
    assert [(r.tenant, r.counts) for r in period(now, start)] == [("acme", (5, 60, 90, 0)), ("zeta", (1, 2, 3, 0))]


def test_a_recreated_service_or_a_later_snapshot_is_refused() -> None:
    start = rows(listing(service("u1", {"acme": (10, 100, 200, 5)})))
    with pytest.raises(ReportError, match="created again"):
        period(rows(listing(service("u2", {"acme": (11, 100, 200, 5)}))), start)
    with pytest.raises(ReportError, match="lower"):
        period(rows(listing(service("u1", {"acme": (9, 100, 200, 5)}))), start)


def test_a_service_deleted_in_the_period_is_never_dropped_silently(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A service in the snapshot and gone now: what it booked after the snapshot is in neither input. It was left
    out with exit 0 (7,000 of 47,000 tokens billed); now it is refused, or left out on request, and named."""
    snapshot, current = tmp_path / "start.json", tmp_path / "now.json"
    snapshot.write_text(json.dumps(listing(service("u1", {"acme": (1, 1, 1, 0)}),
                                           service("u2", {"acme": (2, 2, 2, 0)}, name="code"))))
    current.write_text(json.dumps(listing(service("u1", {"acme": (3, 30, 40, 0)}))))
    assert main([str(current), "--since", str(snapshot)]) == 1
    assert "team/code" in capsys.readouterr().err
    assert main([str(current), "--since", str(snapshot), "--ignore-deleted", "--json"]) == 0
    out = capsys.readouterr()
    assert [json.loads(line)["service"] for line in out.out.splitlines()] == ["chat"]
    assert "left out, deleted in the period: team/code" in out.err


def test_the_command_prints_a_table_and_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "start.json"
    snapshot.write_text(json.dumps(service("u1", {"acme": (1, 1, 1, 0)})))
    current = tmp_path / "now.json"
    current.write_text(json.dumps(listing(service("u1", {"acme": (3, 30, 40, 0)}), {"kind": "Pod"})))
    assert main([str(current), "--since", str(snapshot), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"namespace": "team", "service": "chat", "tenant": "acme",
                                                   "requests": 2, "promptTokens": 29, "completionTokens": 39,
                                                   "cachedTokens": 0}
    assert main([str(current)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["team", "chat", "acme", "3", "30", "40", "0"]
    current.write_text("not json")
    assert main([str(current)]) == 1 and "not JSON" in capsys.readouterr().err


def test_a_budgets_listing_shows_each_tenants_month_at_a_glance(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    budget = {"apiVersion": "serving.tally.dev/v1alpha1", "kind": "Budget", "metadata": {"name": "acme-month"},
              "status": {"period": "2026-12", "tenants": {"acme": {"budget": 2000, "spent": 1900, "held": 60,
                                                                   "remaining": 40, "unspent": 100}}}}
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(listing(budget)))
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["BUDGET", "PERIOD", "TENANT", "LIMIT", "SPENT", "HELD", "REMAINING"]
    assert lines[1].split() == ["acme-month", "2026-12", "acme", "2000", "1900", "60", "40"]
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spent"] == 1900


def test_a_sharded_service_is_read_from_its_usage_shards_and_one_tenant_at_a_glance(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tenants of a service written with shards are in its UsageShards (`other` in several, summed); a
    shard of another service, or one the status layout still owns, is not counted twice."""
    from tally_operator.shard_store import shard_object
    from tally_operator.shards import Shard
    from tally_operator.usage import Ledger

    meta = {"namespace": "team", "name": "chat", "uid": "u1"}
    sharded = {**service("u1", {}), "status": {"usage": {"shardKey": "k", "completionTokens": 33}}}

    def part(index: int, tenants: dict[str, tuple[int, int, int, int]]) -> dict[str, Any]:
        return shard_object(meta, index, {"usage": service("u1", tenants)["status"]["usage"]}, Shard(Ledger(), "7"))

    document = listing(sharded, part(0, {"acme": (1, 2, 3, 0), "other": (1, 1, 1, 0)}),
                       part(5, {"zeta": (2, 2, 20, 0), "other": (1, 1, 9, 0)}),
                       shard_object({**meta, "uid": "u9", "name": "gone"}, 1,
                                    {"usage": service("u9", {"acme": (5, 5, 5, 5)})["status"]["usage"]},
                                    Shard(Ledger(), "1")))
    found = {(r.service, r.tenant): r.counts for r in rows(document)}
    assert found == {("chat", "acme"): (1, 2, 3, 0), ("chat", "other"): (2, 2, 10, 0), ("chat", "zeta"): (2, 2, 20, 0),
                     ("gone", "acme"): (5, 5, 5, 5)}
    legacy = listing(service("u1", {"acme": (1, 1, 1, 1)}), part(0, {"acme": (9, 9, 9, 9)}))
    assert [(r.tenant, r.counts) for r in rows(legacy)] == [("acme", (1, 1, 1, 1))]  # the status still owns them
    path = tmp_path / "now.json"
    path.write_text(json.dumps(document))
    assert main([str(path), "--tenant", "zeta"]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines()[1:]] == [
        ["team", "chat", "zeta", "2", "2", "20", "0"]]


def test_services_without_their_usage_shards_are_refused_never_billed_zero_and_csv_by_namespace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 63, item 1: last round's documented `kubectl get completionservices -A -o json | tally-usage` printed an
    empty table and exited 0 once the tenants moved to UsageShards (a billing job billed zero). No CSV, no
    namespace filter."""
    from tally_operator.shard_store import shard_object
    from tally_operator.shards import Shard
    from tally_operator.usage import Ledger

    def sharded(uid: str, namespace: str, tenants: dict[str, tuple[int, int, int, int]]) -> list[dict[str, Any]]:
        meta = {"namespace": namespace, "name": "chat", "uid": uid}
        obj = {**service(uid, {}), "metadata": meta,
               "status": {"usage": {"shardKey": "k", "tenantCount": len(tenants)}}}
        return [obj, shard_object(meta, 0, {"usage": service(uid, tenants)["status"]["usage"]}, Shard(Ledger(), "1"))]

    a, b = sharded("u1", "team-a", {"acme": (1, 10, 20, 0)}), sharded("u2", "team-b", {"zeta": (2, 5, 5, 1)})
    services_only = tmp_path / "services.json"
    services_only.write_text(json.dumps(listing(a[0], b[0])))
    assert main([str(services_only)]) == 1
    err = capsys.readouterr().err
    assert "team-a/chat" in err and "team-b/chat" in err and "usageshards" in err
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(listing(*a, *b)))
    assert main([str(whole), "--since", str(services_only)]) == 1  # a snapshot without its shards too
    capsys.readouterr()
    assert main([str(whole), "--namespace", "team-b", "--csv"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "namespace,service,tenant,requests,promptTokens,completionTokens,cachedTokens", "team-b,chat,zeta,2,5,5,1"]
    empty = tmp_path / "empty.json"  # a service with no tenant yet has no shard: nothing is missing
    empty.write_text(json.dumps(listing({**a[0], "status": {"usage": {"shardKey": "k", "tenantCount": 0}}})))
    assert main([str(empty), "--csv"]) == 0
