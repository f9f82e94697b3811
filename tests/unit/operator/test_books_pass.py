"""One service's pass as the operator runs it (`books.commit`, against the API server in memory): what it writes
when nothing happened, where its plan runs, and what its gauges keep (issue 59, items 8 and 9)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from money_world import NAMESPACE, new_world

from tally_operator import constants as c
from tally_operator.budget import TenantView
from tally_operator.metrics import OperatorMetrics
from tally_operator.usage import ledger_from_status


def test_an_idle_round_writes_nothing_and_still_says_the_service_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round that books nothing writes neither the status nor a shard (every round rewrote an idle service's
    status); the operator's gauge of the last booked scrape moves all the same (its alert would fire on an idle
    service otherwise), the health window keeps following the persisted ledger, and once `lastScrapeTime` is old
    the status is written again."""
    async def run() -> None:
        world = new_world(2, tenants=20)
        world.serve(50)
        assert await world.run_pass()
        writes = len(world.api.writes)
        gauge = world.metrics.last_scrape.labels(NAMESPACE, "chat")
        gauge.set(0)
        for _ in range(3):
            assert await world.run_pass()
        assert len(world.api.writes) == writes, world.api.writes[writes:]
        assert gauge._value.get() > 0
        obj = world.api.get(c.API_VERSION, c.KIND, "chat", NAMESPACE)
        assert obj is not None
        assert world.memory.observations.sequence == ledger_from_status(obj["status"]["usage"]).sequence
        world.check(True)
        world.serve(5)  # something happens: written at once
        assert await world.run_pass()
        assert len(world.api.writes) > writes
        writes = len(world.api.writes)
        monkeypatch.setattr("tally_operator.bookkeeping.REFRESH_SECONDS", 0)  # the scrape time is old now
        assert await world.run_pass()
        assert len(world.api.writes) == writes + 1  # the status alone
        world.check(True)
    asyncio.run(run())


def test_a_round_is_planned_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan (seconds at 10,000 tenants, twice a second while pods ask) runs in a worker thread: kopf's loop
    serves every other service's pass and lease message meanwhile."""
    import tally_operator.books as books

    threads: list[threading.Thread] = []
    plan = books.plan

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return plan(*args, **kwargs)

    monkeypatch.setattr(books, "plan", recorded)

    async def run() -> None:
        world = new_world(3, tenants=20)
        world.serve(20)
        assert await world.run_pass()
    asyncio.run(run())
    assert threads and all(thread is not threading.main_thread() for thread in threads)


def test_the_budget_gauges_follow_the_tenants_planned() -> None:
    """A tenant no longer planned, or no longer refused, loses its series (they grew by every name a pod asked
    for: 25,001 series after 25 rounds)."""
    metrics = OperatorMetrics()
    view = TenantView(budget=100, spent=10, reserved=0, remaining=90, tokens_per_minute=None)
    for round_ in range(25):
        names = {f"asked-{round_}-{i}": view for i in range(40)}
        metrics.budgets(NAMESPACE, "chat", {"acme": view, **names}, {f"asked-{round_}-0": 1.0})
    series = {s.labels["tenant"] for family in metrics.registry.collect() for s in family.samples
              if family.name.startswith("tally_service_budget") and "tenant" in s.labels}
    assert len(series) == 41 and "acme" in series and "asked-0-0" not in series
    metrics.budgets(NAMESPACE, "other-service", {"acme": view}, {})
    metrics.budgets(NAMESPACE, "chat", {}, {})
    left = [s.labels for family in metrics.registry.collect() for s in family.samples
            if family.name.startswith("tally_service_budget") and "tenant" in s.labels]
    assert left and all(labels["name"] == "other-service" for labels in left)
