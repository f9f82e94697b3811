"""Prometheus series of one runtime process, in a registry owned by the app (no module globals)."""

from __future__ import annotations

import collections
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tally_runtime import contract
from tally_runtime.engine.base import EngineMetrics
from tally_runtime.ledger import Totals, request_key
from tally_runtime.usage import RequestUsage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

# A counter's `_created` series would double every counter series a pod exports: its epoch is
# tally_start_time_seconds already (the counters began there, or at the journal's epoch)
disable_created_metrics()  # type: ignore[no-untyped-call]


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    # The engine's counters also hold its start-up probe, which no client asked for.
    engine_offset: tuple[float, float] = (0.0, 0.0)
    # The usage counters as plain numbers (what the journal stores); given, the series continue from them.
    totals: Totals = field(default_factory=Totals)
    max_tenants: int = 100  # tenant label values beyond this many go to the "other" bucket
    pod_uid: str = ""  # the pod this runtime serves in, as the operator told it

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            contract.REQUESTS, "Requests by endpoint, outcome and finish reason",
            ["endpoint", "outcome", "finish_reason"], registry=r,
        )
        self.prompt_tokens = Counter(contract.PROMPT_TOKENS, "Prompt tokens, as the engine counted them", registry=r)
        self.completion_tokens = Counter(
            contract.COMPLETION_TOKENS, "Completion tokens, as the engine counted them", registry=r
        )
        self.cached_tokens = Counter(contract.CACHED_TOKENS, "Prompt tokens served from the prefix cache", registry=r)
        self.mismatches = Counter(
            contract.USAGE_MISMATCHES, "Choices whose engine completion count differs from the ids streamed", registry=r
        )
        self.derived = Counter(contract.DERIVED_USAGE_REQUESTS,
                               "Requests whose usage was counted by us: the engine reported none", registry=r)
        self.stream_mode = Gauge(contract.STREAM_MODE, "1 for the engine's stream mode in force", ["mode"], registry=r)
        self.inflight = Gauge(contract.INFLIGHT_GENERATIONS, "Generations running in the engine", registry=r)
        self.slots = Gauge(contract.GENERATION_SLOTS, "Generations that may run at once", registry=r)
        self.queued = Gauge(contract.QUEUED_REQUESTS, "Requests waiting for admission", registry=r)
        self.queue_time = Histogram(contract.QUEUE_TIME, "Time admitted requests waited in the queue",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(contract.TIME_TO_FIRST_TOKEN, "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = TokenHistogram(
            contract.INTER_TOKEN_LATENCY, "Latency per generated token after the first", TOKEN_BUCKETS, registry=r
        )
        self.e2e = Histogram(contract.E2E_LATENCY, "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.engine_healthy = Gauge(contract.ENGINE_HEALTHY, "1 when the engine can generate", registry=r)
        self.records_lost = Counter(contract.RECORDS_LOST, "Usage records a sink could not write whole", ["sink"],
                                    registry=r)
        self.connections_refused = Counter(contract.CONNECTIONS_REFUSED, "Connections refused or closed: port (over "
                                           "its cap), client (over its address's before it authenticated), tenant, "
                                           "idle (closed to make room on a full port)", ["why"], registry=r)
        self.records_queued = Gauge(contract.RECORDS_QUEUED, "Usage records spooled and not yet delivered to "
                                    "--usage-records-url", registry=r)
        self.records_oldest = Gauge(contract.RECORDS_OLDEST, "Age of the oldest usage record not yet delivered "
                                    "(0: none)", registry=r)
        self.records_refused = Counter(contract.RECORDS_REFUSED, "Spool lines this runtime did not write: refused, "
                                       "not forwarded", registry=r)
        self.records_delivered = Counter(contract.RECORDS_DELIVERED, "Usage records the receiver took (2xx)",
                                         registry=r)
        self.budget_remaining = Gauge(contract.BUDGET_REMAINING, "Tokens the tenant may still spend on this pod "
                                      "under its lease (counted as the budget counts them)", ["tenant"], registry=r)
        self.budget_reach = Gauge(contract.BUDGET_REACH, "The tenant's counter value this pod may still reach: its "
                                  "allowance, or more while requests admitted under a higher one run", ["tenant"],
                                  registry=r)
        self.budget_sequence = Gauge(contract.BUDGET_SEQUENCE, "The number of the operator's lease message this pod "
                                     "applied last", registry=r)
        self.budget_wanted = Gauge(contract.BUDGET_WANTED, "Tenants refused for want of a lease: the operator grants "
                                   "one in its next round", ["tenant"], registry=r)
        self.budget_refusals = Counter(contract.BUDGET_REFUSALS, "Requests refused with 429 for the tenant's budget "
                                       "or rate", ["tenant", "code"], registry=r)
        self.streams_stalled = Counter(contract.STALLED_STREAMS,
                                       "Streams ended because their client took no data for --send-stall-seconds",
                                       registry=r)
        self.drift = Gauge(contract.ENGINE_USAGE_DRIFT,
                           "Engine-sourced totals we counted minus SGLang's own counters, "
                           "as of the last moment no request was in flight", ["kind"], registry=r)
        self.start_time = Gauge(contract.START_TIME, "When these usage counters began (unix seconds)", registry=r)
        self.draining = Gauge(contract.DRAINING, "1 once the runtime is shutting down", registry=r)
        Gauge(contract.RUNTIME_INFO, "Which pod this runtime serves in", ["pod_uid"], registry=r).labels(
            self.pod_uid).set(1)
        self.journal_healthy = Gauge(contract.JOURNAL_HEALTHY,
                                     "0 while the counter journal cannot be written (a restart starts a new epoch)",
                                     registry=r)
        self.journal_healthy.set(1)
        self.tenant_series = (
            Counter(contract.TENANT_REQUESTS, "Requests served per tenant (refused ones are not)", ["tenant"],
                    registry=r),
            Counter(contract.TENANT_PROMPT_TOKENS, "Prompt tokens per tenant (engine-sourced)", ["tenant"], registry=r),
            Counter(contract.TENANT_COMPLETION_TOKENS, "Completion tokens per tenant (engine-sourced)", ["tenant"],
                    registry=r),
            Counter(contract.TENANT_CACHED_TOKENS, "Cached prompt tokens per tenant", ["tenant"], registry=r),
        )
        self.tenant_sources = Counter(contract.TENANT_SOURCES, "Requests by what named their tenant: key, header, "
                                      "user or none", ["source"], registry=r)
        self.tenant_overflow = Counter(
            contract.TENANT_OVERFLOW,
            f"Requests of tenants beyond the first {self.max_tenants}, booked to tenant={contract.OTHER_TENANT!r}",
            registry=r)
        for mode in contract.STREAM_MODES:
            self.stream_mode.labels(mode).set(0)
        # Each request's series, by label values: prometheus_client's `labels()` costs a lock and a lookup
        self._request_children: dict[str, Any] = {}
        self._source_children: dict[str, Any] = {}
        self._tenant_children: dict[str, tuple[Any, ...]] = {}
        self._claimed: collections.Counter[str] = collections.Counter()  # labels held by requests not recorded yet
        self._resume(self.totals)

    def _resume(self, t: Totals) -> None:
        """Series that continue from a journal (a restarted process of the same pod)."""
        self.start_time.set(t.epoch)
        # SGLang's own counters start from zero with each process: drift compares this process's share.
        self._process_base = (t.engine_side_prompt_tokens, t.completion_tokens)
        for key, count in t.requests.items():
            self.requests.labels(*key.split("|", 2)).inc(count)
        for counter, value in ((self.prompt_tokens, t.prompt_tokens), (self.completion_tokens, t.completion_tokens),
                               (self.cached_tokens, t.cached_tokens), (self.mismatches, t.mismatches),
                               (self.derived, t.derived_requests), (self.tenant_overflow, t.tenant_overflow)):
            if value:
                counter.inc(value)
        for tenant, values in t.tenants.items():
            for series, value in zip(self.tenant_series, values, strict=False):
                series.labels(tenant).inc(value)

    def tenant_label(self, tenant: str) -> str:
        """The tenant's own label while fewer than `max_tenants` were seen (or hold one: `claim_label`); the
        shared bucket beyond."""
        if tenant in self.totals.tenants or tenant in self._claimed or \
                len(self.totals.tenants) + len(self._claimed) < self.max_tenants:
            return tenant
        return contract.OTHER_TENANT

    def claim_label(self, tenant: str) -> bool:
        """Hold the tenant's own label for a request about to be served under a budget, until its reservation
        comes back (`release_label`); False when it has none (it would be counted under `other`, which no
        lease covers). Without it, new tenants admitted at once all found the last label free, and the ones
        recorded after it was taken were billed to `other`."""
        if self.tenant_label(tenant) != tenant:
            return False
        if tenant not in self.totals.tenants:
            self._claimed[tenant] += 1
        return True

    def release_label(self, tenant: str) -> None:
        if self._claimed[tenant] > 1:
            self._claimed[tenant] -= 1
        else:
            self._claimed.pop(tenant, None)

    def record_tenant(self, tenant: str, usage: RequestUsage | None) -> None:
        label = self.tenant_label(tenant)
        if label != tenant:
            self.tenant_overflow.inc()
            self.totals.tenant_overflow += 1
        values = self.totals.tenants.setdefault(label, [0.0, 0.0, 0.0, 0.0])
        self._claimed.pop(label, None)  # in the totals now: its label is its own for good
        counts = (1, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens or 0) if usage else (1, 0, 0, 0)
        children = self._tenant_children.get(label)
        if children is None:  # one lookup per tenant, not four per request (bounded by max_tenants)
            children = self._tenant_children[label] = tuple(series.labels(label) for series in self.tenant_series)
        for i, (child, count) in enumerate(zip(children, counts, strict=True)):
            values[i] += count
            if count:
                child.inc(count)

    def set_stream_mode(self, mode: str) -> None:
        for known in contract.STREAM_MODES:
            self.stream_mode.labels(known).set(1 if known == mode else 0)

    def record_request(self, endpoint: str, outcome: str, finish_reason: str, tenant_source: str | None = None) -> None:
        """One request, and what named its tenant (that count is this process's only: it is not journaled)."""
        key = request_key(endpoint, outcome, finish_reason)
        child = self._request_children.get(key)
        if child is None:  # the label sets are few (endpoints, outcomes, finish reasons): each looked up once
            child = self._request_children[key] = self.requests.labels(endpoint, outcome, finish_reason)
        child.inc()
        self.totals.requests[key] = self.totals.requests.get(key, 0.0) + 1
        if tenant_source is None:
            return
        source = self._source_children.get(tenant_source)
        if source is None:
            source = self._source_children[tenant_source] = self.tenant_sources.labels(tenant_source)
        source.inc()

    def record_usage(self, usage: RequestUsage) -> None:
        t = self.totals
        t.engine_side_prompt_tokens += usage.engine_prompt_tokens
        t.prompt_tokens += usage.prompt_tokens
        t.completion_tokens += usage.completion_tokens
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        if usage.cached_tokens:
            t.cached_tokens += usage.cached_tokens
            self.cached_tokens.inc(usage.cached_tokens)
        if usage.mismatched_choices:
            t.mismatches += usage.mismatched_choices
            self.mismatches.inc(usage.mismatched_choices)
        if usage.derived:
            t.derived_requests += 1
            self.derived.inc()

    def observe_tokens(self, gap_seconds: float, tokens: int) -> None:
        """A chunk of `tokens` tokens arrived `gap_seconds` after the previous one: per-token latency."""
        if tokens > 0:
            self.itl.observe(gap_seconds / tokens, tokens)

    def render(self, engine: EngineMetrics | None = None, settled: bool = True) -> bytes:
        """Our series, then the engine's own, with the drift between its totals and ours.

        An engine like SGLang counts a request when it finishes, before its last item reaches us; we count
        it when its response is done. Between those moments the two disagree by design, so the drift is
        taken only when no request is in flight (`settled`) and otherwise keeps its last settled value."""
        engine = engine or EngineMetrics()
        if settled and engine.prompt_tokens is not None:  # no drift without the engine's own totals
            ours = self.totals.engine_side_prompt_tokens - self._process_base[0]
            self.drift.labels("prompt").set(ours - (engine.prompt_tokens - self.engine_offset[0]))
        if settled and engine.completion_tokens is not None:
            ours = self.totals.completion_tokens - self._process_base[1]
            self.drift.labels("completion").set(ours - (engine.completion_tokens - self.engine_offset[1]))
        return generate_latest(self.registry) + engine.text


class TokenHistogram(Collector):
    """A histogram fed from the event loop only, with many equal observations in one call.

    prometheus_client's Histogram takes a lock and walks its buckets per observation; a stream observes
    every token, so this one adds `count` to one bucket found by bisection. Same exposition (`_bucket`
    with `le`, `_sum`, `_count`).
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf only
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count  # `le` is inclusive: value == bound counts in it
        self.sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)
