"""The operator's own /metrics: usage per CompletionService, labelled by namespace and name.

Usage series are counters (`_total`): they only rise, by what each scrape round added, so `rate()` and
`increase()` work across operator restarts the way Prometheus expects counters to."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tally_operator.samples import Counters
from tally_runtime.contract import OTHER_TENANT

PREFIX = "tally_service"
MAX_TENANTS_PER_SERVICE = 1000  # tenant series per service on this registry; later ones are booked as 'other'
_FIELDS = {
    "requests": "Finished requests",
    "prompt_tokens": "Prompt tokens (engine-sourced)",
    "completion_tokens": "Completion tokens (engine-sourced)",
    "cached_tokens": "Prompt tokens served from the prefix cache",
    "mismatches": "Choices whose engine token count differed from the tokens streamed",
    "derived_requests": "Requests whose usage the runtime had to count itself",
}
_TENANT_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
HEALTH_VALUES = {"True": 1.0, "False": 0.0, "Unknown": -1.0}


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["namespace", "name"]
        self.totals = {f: Counter(f"{PREFIX}_{f}", text, labels, registry=self.registry) for f, text in _FIELDS.items()}
        tenant_labels = [*labels, "tenant"]
        self.tenants = {f: Counter(f"{PREFIX}_tenant_{f}", f"{text}, per tenant", tenant_labels, registry=self.registry)
                        for f, text in _FIELDS.items() if f in _TENANT_FIELDS}
        self.seen_tenants: dict[tuple[str, str], set[str]] = {}
        self.unaccounted = Counter(f"{PREFIX}_pods_unaccounted", "Pods whose last counters were never read",
                                   labels, registry=self.registry)
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
        self.desired_replicas = Gauge(f"{PREFIX}_desired_replicas", "Pods autoscaling decided on", labels,
                                      registry=self.registry)
        self.scaling_signal = Gauge(f"{PREFIX}_autoscaling_signal",
                                    "The autoscaling metric summed over the pods, averaged over the stable window",
                                    labels, registry=self.registry)

    def serve(self, port: int, address: str) -> None:
        start_http_server(port, addr=address, registry=self.registry)

    def record(self, namespace: str, name: str, increase: Counters, health: str, scraped: int, failed: int,
               unaccounted: int = 0, tenants: Mapping[str, Counters] | None = None) -> int:
        """Count one booked round. Returns how many tenants beyond the per-service bound were booked to
        tenant `other` this time."""
        for field, counter in self.totals.items():
            counter.labels(namespace, name).inc(getattr(increase, field))
        seen = self.seen_tenants.setdefault((namespace, name), set())
        folded = 0
        for tenant, more in sorted((tenants or {}).items()):
            label = tenant
            if tenant not in seen and len(seen) - (OTHER_TENANT in seen) >= MAX_TENANTS_PER_SERVICE:
                label, folded = OTHER_TENANT, folded + (tenant != OTHER_TENANT)
            seen.add(label)
            for field, counter in self.tenants.items():
                counter.labels(namespace, name, label).inc(getattr(more, field))
        self.unaccounted.labels(namespace, name).inc(unaccounted)  # at 0 from the start: increase() sees the first
        self.healthy.labels(namespace, name).set(HEALTH_VALUES.get(health, -1.0))
        self.last_scrape.labels(namespace, name).set_to_current_time()
        self.pods_scraped.labels(namespace, name).set(scraped)
        self.scrape_failures.labels(namespace, name).inc(failed)
        return folded

    def workload(self, namespace: str, name: str, replicas: int, ready: int) -> None:
        self.replicas.labels(namespace, name).set(replicas)
        self.ready_replicas.labels(namespace, name).set(ready)

    def scaling(self, namespace: str, name: str, replicas: int, desired: int, signal: float | None) -> None:
        self.desired_replicas.labels(namespace, name).set(desired)
        if signal is not None:
            self.scaling_signal.labels(namespace, name).set(signal)

    def forget(self, namespace: str, name: str) -> None:
        for tenant in self.seen_tenants.pop((namespace, name), set()):
            for counter in self.tenants.values():
                with contextlib.suppress(KeyError):
                    counter.remove(namespace, name, tenant)
        for metric in (*self.totals.values(), self.unaccounted, self.healthy, self.pods_scraped, self.scrape_failures,
                       self.replicas, self.ready_replicas, self.last_scrape, self.desired_replicas,
                       self.scaling_signal):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, name)
