"""The operator's own /metrics: usage per CompletionService, labelled by namespace and name.

The usage series (`_total`, per service and per tenant) are the durable ledger itself, as the last status
write this process made or read left it: they are counters that never re-baseline, so a restarted operator
or a peer taking over exports the same numbers the status holds, and `increase()` over them is exact
wherever the scrapes fall. Tenants are the ledger's (bounded by it: shards.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tally_operator.budget import TenantView
from tally_operator.samples import TENANT_FIELDS
from tally_operator.usage import Ledger

PREFIX = "tally_service"
_FIELDS = {
    "requests": "Finished requests",
    "prompt_tokens": "Prompt tokens (engine-sourced)",
    "completion_tokens": "Completion tokens (engine-sourced)",
    "cached_tokens": "Prompt tokens served from the prefix cache",
    "mismatches": "Choices whose engine token count differed from the tokens streamed",
    "derived_requests": "Requests whose usage the runtime had to count itself",
}
HEALTH_VALUES = {"True": 1.0, "False": 0.0, "Unknown": -1.0}


class LedgerSeries(Collector):
    """Each service's ledger as counter families, read at scrape time from the last ledger kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # kept from kopf's loop, collected from the HTTP server's thread
        self._ledgers: dict[tuple[str, str], tuple[Ledger, float | None]] = {}

    def keep(self, namespace: str, name: str, ledger: Ledger, created: float | None = None) -> None:
        """Export `ledger` unless a later one is kept already (a stale body never takes a counter back).
        `created`: when the service was created, where its counters began at zero (exported as each series'
        created timestamp, so Prometheus counts a series' first value too)."""
        with self._lock:
            kept = self._ledgers.get((namespace, name))
            if kept is None or ledger.sequence >= kept[0].sequence:
                self._ledgers[(namespace, name)] = (ledger, created)

    def has(self, namespace: str, name: str) -> bool:
        with self._lock:
            return (namespace, name) in self._ledgers

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._ledgers.pop((namespace, name), None)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:
            ledgers = sorted(self._ledgers.items())
        labels = ["namespace", "name"]
        for field, text in _FIELDS.items():
            family = CounterMetricFamily(f"{PREFIX}_{field}", text, labels=labels)
            for (namespace, name), (ledger, created) in ledgers:
                family.add_metric([namespace, name], getattr(ledger.totals, field), created=created)
            yield family
            if field in TENANT_FIELDS:
                tenants = CounterMetricFamily(f"{PREFIX}_tenant_{field}", f"{text}, per tenant",
                                              labels=[*labels, "tenant"])
                for (namespace, name), (ledger, created) in ledgers:
                    for tenant, counters in sorted(ledger.tenants.items()):
                        tenants.add_metric([namespace, name, tenant], getattr(counters, field), created=created)
                yield tenants
        unaccounted = CounterMetricFamily(f"{PREFIX}_pods_unaccounted", "Pods whose last counters were never read",
                                          labels=labels)
        folded = CounterMetricFamily(f"{PREFIX}_tenants_folded", "Tenant names booked to 'other': the ledger was full",
                                     labels=labels)
        for (namespace, name), (ledger, created) in ledgers:
            unaccounted.add_metric([namespace, name], ledger.unaccounted, created=created)
            folded.add_metric([namespace, name], ledger.tenants_folded, created=created)
        yield unaccounted
        yield folded


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["namespace", "name"]
        self.ledgers = LedgerSeries()
        self.registry.register(self.ledgers)
        self.healthy = Gauge(f"{PREFIX}_usage_healthy", "UsageHealthy: 1 True, 0 False, -1 Unknown", labels,
                             registry=self.registry)
        self.pods_scraped = Gauge(f"{PREFIX}_pods_scraped", "Pods scraped in the last round", labels,
                                  registry=self.registry)
        self.scrape_failures = Counter(f"{PREFIX}_scrape_failures", "Pod scrapes that failed", labels,
                                       registry=self.registry)
        self.replicas = Gauge(f"{PREFIX}_replicas", "Pods the service runs (asked for)", labels,
                              registry=self.registry)
        self.ready_replicas = Gauge(f"{PREFIX}_ready_replicas", "Pods ready to serve", labels, registry=self.registry)
        self.last_scrape = Gauge(f"{PREFIX}_last_scrape_timestamp_seconds",
                                 "When the last scrape round of the service's pods was booked (unix seconds)", labels,
                                 registry=self.registry)
        self.budget_remaining = Gauge(f"{PREFIX}_budget_remaining_tokens", "What the tenant may still spend this "
                                      "period: its budget less its spend and what pods hold under leases",
                                      [*labels, "tenant"], registry=self.registry)
        self.budget_spent = Gauge(f"{PREFIX}_budget_spent_tokens", "What the tenant spent this period (as its budget "
                                  "counts tokens)", [*labels, "tenant"], registry=self.registry)
        self.budget_refusals = Gauge(f"{PREFIX}_budget_refusals", "429s for the tenant's budget or rate, counted "
                                     "by the pods read in the last round (a pod replaced takes its count along)",
                                     [*labels, "tenant"], registry=self.registry)
        self.desired_replicas = Gauge(f"{PREFIX}_desired_replicas", "Pods autoscaling decided on", labels,
                                      registry=self.registry)
        self.scaling_signal = Gauge(f"{PREFIX}_autoscaling_signal",
                                    "The autoscaling metric summed over the pods, averaged over the stable window",
                                    labels, registry=self.registry)
        self.held_requests = Gauge(f"{PREFIX}_held_requests", "Scale to zero: requests the activator holds, "
                                   "waiting for a pod", labels, registry=self.registry)
        self.picker_ready = Gauge(f"{PREFIX}_picker_ready", "InferencePool routing: 1 when the service's endpoint "
                                  "picker is ready, 0 when not (the gateway then fails its requests open or closed)",
                                  labels, registry=self.registry)
        self.cold_start = Gauge(f"{PREFIX}_cold_start_seconds", "Scale to zero: the last held request's time "
                                "from held to its response's first byte", labels, registry=self.registry)

    def serve(self, port: int, address: str) -> None:
        start_http_server(port, addr=address, registry=self.registry)

    def record(self, namespace: str, name: str, ledger: Ledger, health: str, scraped: int, failed: int,
               created: float | None = None) -> None:
        """One booked round: the ledger as written, and what the round saw."""
        self.ledgers.keep(namespace, name, ledger, created)
        self.healthy.labels(namespace, name).set(HEALTH_VALUES.get(health, -1.0))
        self.last_scrape.labels(namespace, name).set_to_current_time()
        self.pods_scraped.labels(namespace, name).set(scraped)
        self.scrape_failures.labels(namespace, name).inc(failed)

    def budgets(self, namespace: str, name: str, tenants: Mapping[str, TenantView],
                refusals: Mapping[str, float]) -> None:
        """The tenants' gauges as this round planned them; a tenant no longer planned (or refused) loses its series
        (they grew by every name a pod ever asked for)."""
        for gauge, kept in ((self.budget_remaining, tenants), (self.budget_spent, tenants),
                            (self.budget_refusals, refusals)):
            for labels in [k for k in list(gauge._metrics) if k[:2] == (namespace, name) and k[2] not in kept]:
                gauge.remove(*labels)
        for tenant, view in tenants.items():
            self.budget_remaining.labels(namespace, name, tenant).set(view.remaining)
            self.budget_spent.labels(namespace, name, tenant).set(view.spent)
        for tenant, refused in refusals.items():
            self.budget_refusals.labels(namespace, name, tenant).set(refused)

    def workload(self, namespace: str, name: str, replicas: int, ready: int) -> None:
        self.replicas.labels(namespace, name).set(replicas)
        self.ready_replicas.labels(namespace, name).set(ready)

    def scaling(self, namespace: str, name: str, replicas: int, desired: int, signal: float | None) -> None:
        self.desired_replicas.labels(namespace, name).set(desired)
        if signal is not None:
            self.scaling_signal.labels(namespace, name).set(signal)

    def activation(self, namespace: str, name: str, held: int, cold_start: float | None) -> None:
        self.held_requests.labels(namespace, name).set(held)
        if cold_start is not None:
            self.cold_start.labels(namespace, name).set(cold_start)

    def forget(self, namespace: str, name: str) -> None:
        self.ledgers.forget(namespace, name)
        for gauge in (self.budget_remaining, self.budget_spent, self.budget_refusals):
            for labels in [k for k in gauge._metrics if k[:2] == (namespace, name)]:
                gauge.remove(*labels)
        for metric in (self.healthy, self.pods_scraped, self.scrape_failures,
                       self.replicas, self.ready_replicas, self.last_scrape, self.desired_replicas,
                       self.scaling_signal, self.held_requests, self.cold_start, self.picker_ready):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, name)
