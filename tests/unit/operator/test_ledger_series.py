"""The operator's usage series are the ledger: exported as kept, never taken back by a stale body, read
safely from the metrics server's thread while passes keep newer ledgers."""

from __future__ import annotations

import threading

from prometheus_client import generate_latest

from tally_operator.metrics import OperatorMetrics
from tally_operator.samples import Counters
from tally_operator.usage import Ledger


def ledger(sequence: int, completion: float) -> Ledger:
    return Ledger(totals=Counters(requests=sequence, completion_tokens=completion), sequence=sequence,
                  tenants={"acme": Counters(requests=sequence, completion_tokens=completion)}, unaccounted=1)


def value(metrics: OperatorMetrics, series: str, **labels: str) -> float | None:
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == series and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def test_the_series_are_the_ledger_and_a_stale_one_never_takes_them_back() -> None:
    metrics = OperatorMetrics()
    metrics.ledgers.keep("ns", "svc", ledger(5, 500))
    assert value(metrics, "tally_service_completion_tokens_total", name="svc") == 500
    assert value(metrics, "tally_service_tenant_completion_tokens_total", tenant="acme") == 500
    assert value(metrics, "tally_service_pods_unaccounted_total", name="svc") == 1
    metrics.ledgers.keep("ns", "svc", ledger(4, 400))  # a pass on a body from before the last write
    assert value(metrics, "tally_service_completion_tokens_total", name="svc") == 500
    metrics.forget("ns", "svc")
    assert value(metrics, "tally_service_completion_tokens_total", name="svc") is None
    assert b"tally_service_tenant_completion_tokens_total{" not in generate_latest(metrics.registry)


def test_scrapes_from_another_thread_see_each_series_only_rise() -> None:
    metrics = OperatorMetrics()
    stop = threading.Event()
    seen: list[float] = []

    def scraper() -> None:
        while not stop.is_set():
            current = value(metrics, "tally_service_tenant_completion_tokens_total", tenant="acme")
            if current is not None:
                seen.append(current)

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        for sequence in range(1, 3000):
            stale = sequence - 7 if sequence % 3 == 0 else sequence  # stale bodies interleaved
            metrics.ledgers.keep("ns", "svc", ledger(max(1, stale), 10.0 * max(1, stale)))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert seen and seen == sorted(seen)
    assert value(metrics, "tally_service_completion_tokens_total", name="svc") == 29_990


def test_each_series_says_it_began_at_zero_when_the_service_was_created() -> None:
    """A Prometheus with created-timestamp zero ingestion then counts a series' first value too (a tenant's
    first tokens, or everything a restarted operator exports): the README's monthly query relies on it."""
    metrics = OperatorMetrics()
    metrics.ledgers.keep("ns", "svc", ledger(3, 30), created=1_700_000_000.0)
    assert value(metrics, "tally_service_tenant_completion_tokens_created", tenant="acme") == 1_700_000_000.0
    assert value(metrics, "tally_service_completion_tokens_created", name="svc") == 1_700_000_000.0
