"""PURE: a runtime's /metrics text -> the counters and gauges the operator reads from one pod."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families

from tally_runtime import contract


@dataclass(frozen=True, slots=True)
class Counters:
    requests: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    cached_tokens: float = 0.0
    mismatches: float = 0.0
    derived_requests: float = 0.0

    def increase_since(self, other: Counters) -> Counters:
        """Increase since `other`; a counter that went down was reset, so all of it is new."""
        return Counters(**{f.name: _increase(getattr(other, f.name), getattr(self, f.name)) for f in fields(self)})

    def plus(self, other: Counters) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def _increase(before: float, now: float) -> float:
    return now - before if now >= before else now


@dataclass(frozen=True, slots=True)
class PodSample:
    counters: Counters
    stream_mode: str  # incremental | cumulative | unknown
    completion_drift: float | None = None  # ours minus SGLang's, when SGLang's series are present
    started: float | None = None  # the counters' epoch: a new value means they began again from zero
    final: bool = False  # draining with nothing in flight: the pod's last counters
    tenants: Mapping[str, Counters] = field(default_factory=dict)  # requests and tokens per tenant


_COUNTER_NAMES = {
    contract.sample_name(contract.REQUESTS): "requests",
    contract.sample_name(contract.PROMPT_TOKENS): "prompt_tokens",
    contract.sample_name(contract.COMPLETION_TOKENS): "completion_tokens",
    contract.sample_name(contract.CACHED_TOKENS): "cached_tokens",
    contract.sample_name(contract.USAGE_MISMATCHES): "mismatches",
    contract.sample_name(contract.DERIVED_USAGE_REQUESTS): "derived_requests",
}


_FINAL_GAUGES = {contract.DRAINING, contract.INFLIGHT_GENERATIONS, contract.QUEUED_REQUESTS}
_TENANT_NAMES = {
    contract.sample_name(contract.TENANT_REQUESTS): "requests",
    contract.sample_name(contract.TENANT_PROMPT_TOKENS): "prompt_tokens",
    contract.sample_name(contract.TENANT_COMPLETION_TOKENS): "completion_tokens",
    contract.sample_name(contract.TENANT_CACHED_TOKENS): "cached_tokens",
}


_REFUSED = {contract.OUTCOME_INVALID, contract.OUTCOME_OVERLOADED}  # never started: not finished requests


class MetricsParseError(ValueError):
    pass


def parse_sample(text: str) -> PodSample:
    """Read a runtime's /metrics text. Requests count only finished ones (not invalid or overloaded)."""
    values = dict.fromkeys(_COUNTER_NAMES.values(), 0.0)
    modes: dict[str, float] = {}
    drift: float | None = None
    started: float | None = None
    gauges: dict[str, float] = {}
    tenants: dict[str, dict[str, float]] = {}
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = _COUNTER_NAMES.get(sample.name)
                if name == "requests" and sample.labels.get("outcome") in _REFUSED:
                    continue
                if name is not None:
                    values[name] += sample.value
                    seen = True
                elif sample.name == contract.STREAM_MODE:
                    modes[sample.labels.get("mode", "")] = sample.value
                elif sample.name == contract.ENGINE_USAGE_DRIFT and sample.labels.get("kind") == "completion":
                    drift = sample.value
                elif sample.name == contract.START_TIME:
                    started = sample.value
                elif sample.name in _FINAL_GAUGES:
                    gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value
                elif sample.name in _TENANT_NAMES:
                    tenant = tenants.setdefault(sample.labels.get("tenant", ""), {})
                    tenant[_TENANT_NAMES[sample.name]] = sample.value
    except (ValueError, TypeError, KeyError) as err:
        raise MetricsParseError(f"not Prometheus text: {err}") from None
    if not seen:
        raise MetricsParseError("no Tally usage series in the response")
    mode = next((k for k, v in modes.items() if v == 1), "unknown")
    final = gauges.get(contract.DRAINING) == 1 and not gauges.get(contract.INFLIGHT_GENERATIONS) \
        and not gauges.get(contract.QUEUED_REQUESTS)
    return PodSample(Counters(**values), mode, drift, started, final,
                     {tenant: Counters(**counts) for tenant, counts in tenants.items()})


def stream_mode(samples: Iterable[PodSample]) -> str:
    modes = {s.stream_mode for s in samples}
    if not modes:
        return "unknown"
    return modes.pop() if len(modes) == 1 else "mixed"
