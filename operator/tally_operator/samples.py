"""PURE: a runtime's /metrics text -> the counters and gauges the operator reads from one pod.

A pod's /metrics is input from outside the operator: whatever runs in the pod could send anything. A
sample is refused whole (`MetricsParseError`, the round counts the pod as failed) unless it names the pod
it was meant to come from, carries its counters' epoch, and every number read is finite and not negative.
Tenant series are bounded: a pod reporting more than `MAX_TENANTS_PER_POD` tenants, or whose tenant series
do not sum to its totals (requests served, prompt, completion and cached tokens), is refused: the ledger
books tenants from the same readings as the totals and keeps their sums equal (usage.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from tally_runtime import contract
from tally_runtime.contract import MAX_TENANT_LENGTH

MAX_TENANTS_PER_POD = 1000  # tenant label values a pod may report (the runtime keeps --max-tenants, 100)
TENANT_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")  # counted per tenant too


@dataclass(frozen=True, slots=True)
class Counters:
    requests: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    cached_tokens: float = 0.0
    mismatches: float = 0.0
    derived_requests: float = 0.0

    def values(self) -> tuple[float, ...]:
        return (self.requests, self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.mismatches,
                self.derived_requests)

    def increase_since(self, other: Counters) -> Counters:
        """Increase since `other` under one epoch: a counter that went down adds nothing (never a reset:
        a reset comes with a new epoch, and the caller then passes zero counters)."""
        return Counters(max(0.0, self.requests - other.requests), max(0.0, self.prompt_tokens - other.prompt_tokens),
                        max(0.0, self.completion_tokens - other.completion_tokens),
                        max(0.0, self.cached_tokens - other.cached_tokens),
                        max(0.0, self.mismatches - other.mismatches),
                        max(0.0, self.derived_requests - other.derived_requests))

    def below(self, other: Counters) -> bool:
        """Whether any counter is lower than in `other`."""
        return any(a < b for a, b in zip(self.values(), other.values(), strict=True))

    def plus(self, other: Counters) -> Counters:
        return Counters(self.requests + other.requests, self.prompt_tokens + other.prompt_tokens,
                        self.completion_tokens + other.completion_tokens, self.cached_tokens + other.cached_tokens,
                        self.mismatches + other.mismatches, self.derived_requests + other.derived_requests)

    def any(self) -> bool:
        return any(self.values())

    def tenant_part(self) -> Counters:
        """Only the fields counted per tenant (requests and the three token counts)."""
        return Counters(self.requests, self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def capped(self, limit: float) -> Counters:
        """Each counter at most `limit` (a total the status can always hold as an exact integer)."""
        return Counters(*(min(limit, value) for value in self.values()))


@dataclass(frozen=True, slots=True)
class PodSample:
    counters: Counters
    stream_mode: str  # incremental | cumulative | unknown
    completion_drift: float | None = None  # ours minus SGLang's, when SGLang's series are present
    started: float | None = None  # the counters' epoch: a new value means they began again from zero
    final: bool = False  # draining with nothing in flight: the pod's last counters
    tenants: Mapping[str, Counters] = field(default_factory=dict)  # requests and tokens per tenant
    all_requests: float = 0.0  # requests of every outcome, refused ones included (the final-read handshake)
    pod_uid: str = ""  # the pod the runtime says it is (downward API)
    load: Mapping[str, float] = field(default_factory=dict)  # autoscaling signals: gauge name -> value
    wanted: Mapping[str, int] = field(default_factory=dict)  # tenant -> tokens its requests wait for (budget.py)
    refusals: Mapping[str, float] = field(default_factory=dict)  # tenant -> 429s for its budget or rate, so far
    lease_seq: int = 0  # the number of the lease message the pod applied last (0: none)
    reach: Mapping[str, int] = field(default_factory=dict)  # tenant -> counter value the pod may still reach
    records_lost: int = 0  # usage records its delivery could not deliver (spool full, or drained undelivered)

    def acknowledgement(self) -> dict[str, float]:
        """The final counters as the runtime's final-read handshake expects them back (drain.py)."""
        return {"epoch": self.started or 0.0, "requests": self.all_requests,
                "promptTokens": self.counters.prompt_tokens, "completionTokens": self.counters.completion_tokens,
                "cachedTokens": self.counters.cached_tokens}


_COUNTER_NAMES = {
    contract.sample_name(contract.REQUESTS): "requests",
    contract.sample_name(contract.PROMPT_TOKENS): "prompt_tokens",
    contract.sample_name(contract.COMPLETION_TOKENS): "completion_tokens",
    contract.sample_name(contract.CACHED_TOKENS): "cached_tokens",
    contract.sample_name(contract.USAGE_MISMATCHES): "mismatches",
    contract.sample_name(contract.DERIVED_USAGE_REQUESTS): "derived_requests",
}


_FINAL_GAUGES = {contract.DRAINING, contract.INFLIGHT_GENERATIONS, contract.QUEUED_REQUESTS}
# What autoscaling reads (autoscale.py), besides the two gauges above: the slots, SGLang's queue and KV cache
_LOAD_GAUGES = {contract.INFLIGHT_GENERATIONS, contract.QUEUED_REQUESTS, contract.GENERATION_SLOTS,
                *contract.SGLANG_QUEUE_GAUGES, contract.SGLANG_KV_CACHE_USAGE}
_TENANT_NAMES = {
    contract.sample_name(contract.TENANT_REQUESTS): "requests",
    contract.sample_name(contract.TENANT_PROMPT_TOKENS): "prompt_tokens",
    contract.sample_name(contract.TENANT_COMPLETION_TOKENS): "completion_tokens",
    contract.sample_name(contract.TENANT_CACHED_TOKENS): "cached_tokens",
}
_READ = {*_COUNTER_NAMES, *_LOAD_GAUGES, *_TENANT_NAMES, contract.START_TIME, contract.RUNTIME_INFO,
         contract.DRAINING, contract.BUDGET_WANTED, contract.sample_name(contract.BUDGET_REFUSALS),
         contract.BUDGET_REACH, contract.BUDGET_SEQUENCE, contract.sample_name(contract.RECORDS_LOST)}


MAX_LOAD = 1e9  # no pod queues or runs this many requests: a larger gauge is not to be scaled on
MAX_COUNT = float(2**53)  # the largest counter read: every whole number up to it is exact in a float
_COUNTS = {*_COUNTER_NAMES, *_TENANT_NAMES, contract.BUDGET_SEQUENCE}


class MetricsParseError(ValueError):
    pass


def parse_sample(text: str, expected_pod_uid: str | None = None) -> PodSample:
    """Read a runtime's /metrics text. `requests` counts only served requests (not invalid or overloaded);
    given `expected_pod_uid`, the runtime must say it is that pod."""
    values = dict.fromkeys(_COUNTER_NAMES.values(), 0.0)
    modes: dict[str, float] = {}
    drift: float | None = None
    started: float | None = None
    pod_uid: str | None = None
    gauges: dict[str, float] = {}
    tenants: dict[str, dict[str, float]] = {}
    all_requests = 0.0
    wanted: dict[str, int] = {}
    refusals: dict[str, float] = {}
    reach: dict[str, int] = {}
    lease_seq = 0
    records_lost = 0
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _READ:
                    _check(sample.name, sample.value, count=sample.name in _COUNTS)
                name = _COUNTER_NAMES.get(sample.name)
                if name == "requests":
                    all_requests += sample.value
                    if sample.labels.get("outcome") in contract.REFUSED_OUTCOMES:
                        continue
                if name is not None:
                    values[name] += sample.value
                    seen = True
                elif sample.name == contract.STREAM_MODE:
                    modes[sample.labels.get("mode", "")] = sample.value
                elif sample.name == contract.ENGINE_USAGE_DRIFT and sample.labels.get("kind") == "completion":
                    drift = sample.value if math.isfinite(sample.value) else None
                elif sample.name == contract.START_TIME:
                    started = sample.value
                elif sample.name == contract.RUNTIME_INFO:
                    pod_uid = sample.labels.get("pod_uid", "")
                elif sample.name in _FINAL_GAUGES or sample.name in _LOAD_GAUGES:
                    gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value
                elif sample.name == contract.sample_name(contract.BUDGET_REFUSALS):
                    tenant_name = sample.labels.get("tenant", "")
                    refusals[tenant_name] = refusals.get(tenant_name, 0.0) + sample.value
                elif sample.name == contract.sample_name(contract.RECORDS_LOST):
                    if sample.labels.get("sink") == "delivery":
                        records_lost = int(min(sample.value, MAX_COUNT))
                elif sample.name == contract.BUDGET_SEQUENCE:
                    lease_seq = int(sample.value)
                elif sample.name == contract.BUDGET_REACH:  # rounded up: a bound is never understated
                    reach[sample.labels.get("tenant", "")] = math.ceil(min(sample.value, MAX_COUNT))
                elif sample.name == contract.BUDGET_WANTED:
                    if sample.value > 0:  # rounded up, and no more than a count can be
                        wanted[sample.labels.get("tenant", "")] = math.ceil(min(sample.value, MAX_COUNT))
                elif sample.name in _TENANT_NAMES:
                    tenant = tenants.setdefault(sample.labels.get("tenant", ""), {})
                    tenant[_TENANT_NAMES[sample.name]] = sample.value
    except MetricsParseError:
        raise
    except (ValueError, TypeError, KeyError) as err:
        raise MetricsParseError(f"not Prometheus text: {err}") from None
    if not seen:
        raise MetricsParseError("no Tally usage series in the response")
    for name, value in [*values.items(), ("requests of every outcome", all_requests)]:  # sums of label sets
        if value > MAX_COUNT:
            raise MetricsParseError(f"{name} sums to {value:g}: counters above 2^53 are not a pod's")
    if started is None or started <= 0:
        raise MetricsParseError(f"no {contract.START_TIME}: the counters' epoch is unknown")
    if expected_pod_uid is not None and pod_uid != expected_pod_uid:
        raise MetricsParseError(f"the runtime says it is pod {pod_uid or 'unknown'!r}, not {expected_pod_uid!r}")
    mode = next((k for k, v in modes.items() if v == 1), "unknown")
    final = gauges.get(contract.DRAINING) == 1 and not gauges.get(contract.INFLIGHT_GENERATIONS) \
        and not gauges.get(contract.QUEUED_REQUESTS)
    if len(wanted) > MAX_TENANTS_PER_POD or len(refusals) > MAX_TENANTS_PER_POD + 1 or \
            len(reach) > 2 * MAX_TENANTS_PER_POD:
        raise MetricsParseError(f"{max(len(wanted), len(refusals), len(reach))} tenants in the budget series: more "
                                f"than a pod may report ({MAX_TENANTS_PER_POD})")
    if len(tenants) > MAX_TENANTS_PER_POD + 1:
        raise MetricsParseError(f"{len(tenants)} tenants: more than the {MAX_TENANTS_PER_POD} a pod may report")
    for name in (*tenants, *wanted, *reach, *refusals):
        if not is_tenant_name(name):
            raise MetricsParseError(f"a tenant label of {len(name)} characters: a runtime names tenants with at "
                                    f"most {MAX_TENANT_LENGTH}")
    per_tenant = {t: Counters(**counts) for t, counts in tenants.items()}
    counters = Counters(**values)
    summed = Counters()
    for tenant_counters in per_tenant.values():
        summed = summed.plus(tenant_counters)
    if summed != counters.tenant_part():
        raise MetricsParseError("the tenant series do not sum to the totals")
    load = {name: gauges[name] for name in _LOAD_GAUGES if name in gauges}
    for name, value in load.items():  # summed over label sets: each was finite, the sum may not be
        if not value <= MAX_LOAD:
            raise MetricsParseError(f"{name} is {value}: an autoscaling signal above {MAX_LOAD:g} is not a pod's")
    return PodSample(counters, mode, drift, started, final, per_tenant, all_requests, pod_uid or "", load,
                     wanted, refusals, lease_seq, reach, records_lost)


def is_tenant_name(name: str) -> bool:
    """A name a runtime can give a tenant (tally_runtime/auth.py cuts every name to this length)."""
    return len(name) <= MAX_TENANT_LENGTH


def _check(name: str, value: float, count: bool) -> None:
    if not math.isfinite(value) or value < 0:
        raise MetricsParseError(f"{name} is {value}: counters must be finite and not negative")
    if count and (value > MAX_COUNT or value != int(value)):
        raise MetricsParseError(f"{name} is {value:g}: a count is a whole number no larger than 2^53")


def stream_mode(samples: Iterable[PodSample]) -> str:
    modes = {s.stream_mode for s in samples}
    if not modes:
        return "unknown"
    return modes.pop() if len(modes) == 1 else "mixed"
