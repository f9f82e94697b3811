"""PURE: scraped runtime metrics -> per-service usage totals and a usage-health verdict.

Counters are read per pod; the operator keeps each pod's last reading (by pod uid and the counters'
epoch) and adds only the increase. The readings are written to the status with the totals, in the same
write, so a restarted operator or its peer continues exactly. A pod that is unready or cannot be scraped
keeps its reading; a pod is forgotten only once the API server no longer lists it. If its last reading
was not final (the runtime drained and idle), whatever it served after that reading is missing: the pod
is counted in `podsUnaccounted`. The verdict looks at a window of recent rounds and has hysteresis: it
turns unhealthy at once, and healthy again only after several clean rounds in a row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tally_operator import constants as c
from tally_operator.conditions import Verdict
from tally_runtime import contract

WINDOW_ROUNDS = 10
HEALTHY_STREAK = 2


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


@dataclass(frozen=True, slots=True)
class Reading:
    """The last counters read from one pod, and under which epoch.

    Per-tenant counters are kept in memory only (None after a restart: the next reading is their new
    baseline), so the status stays small; the totals themselves are exact across restarts."""

    counters: Counters
    epoch: float | None
    final: bool = False
    tenants: Mapping[str, Counters] | None = None


@dataclass
class UsageState:
    """What the operator remembers per service between rounds; `readings` and the totals are persisted."""

    readings: dict[str, Reading] = field(default_factory=dict)  # pod uid -> its last reading
    totals: Counters = field(default_factory=Counters)
    unaccounted: int = 0
    # Every pod counted so far has a reading. False only after an upgrade from a status without readings:
    # then pods seen first are a baseline, not new usage.
    complete: bool = True
    window: deque[Counters] = field(default_factory=lambda: deque(maxlen=WINDOW_ROUNDS))
    # pod uid -> its recent drift readings (this epoch): only a change within the window counts
    drifts: dict[str, deque[float]] = field(default_factory=dict)
    good_streak: int = 0
    unhealthy: Verdict | None = None  # the last definite verdict, when False: True needs a clean streak
    tenant_increase: dict[str, Counters] = field(default_factory=dict)  # the last round's, per tenant


@dataclass(frozen=True, slots=True)
class Round:
    samples: Mapping[str, PodSample]  # pod uid -> sample, for pods scraped successfully
    failed: frozenset[str] = frozenset()  # pod uids that could not be scraped
    present: frozenset[str] | None = None  # every pod the API server lists (None: the scraped and failed ones)


def absorb(state: UsageState, round_: Round) -> Counters:
    """Add this round's increases to the totals; returns the round's increase."""
    increase = Counters()
    state.tenant_increase = {}
    for uid, sample in round_.samples.items():
        before = state.readings.get(uid)
        tenant_base = _tenant_base(before, sample, state.complete)
        if before is None:
            base = Counters() if state.complete else sample.counters  # new pod: all of it is new usage
        elif sample.started != before.epoch:
            # The counters began again (a process restart without its journal): all of them are new,
            # even where they already climbed past the old values; what came after the last reading is lost.
            base = Counters()
            state.unaccounted += 0 if before.final else 1
            state.drifts.pop(uid, None)
        else:
            base = before.counters
        increase = increase.plus(sample.counters.increase_since(base))
        for tenant, counters in sample.tenants.items():
            more = counters.increase_since(tenant_base.get(tenant, Counters()))
            state.tenant_increase[tenant] = state.tenant_increase.get(tenant, Counters()).plus(more)
        if sample.completion_drift is not None:
            state.drifts.setdefault(uid, deque(maxlen=WINDOW_ROUNDS)).append(sample.completion_drift)
        state.readings[uid] = Reading(sample.counters, sample.started, sample.final, sample.tenants)
    present = round_.present if round_.present is not None else frozenset(round_.samples) | round_.failed
    for gone in set(state.readings) - present:
        if not state.readings.pop(gone).final:
            state.unaccounted += 1
        state.drifts.pop(gone, None)
    state.complete = True
    state.totals = state.totals.plus(increase)
    state.window.append(increase)
    return increase


def _tenant_base(before: Reading | None, sample: PodSample, complete: bool) -> Mapping[str, Counters]:
    if before is None:
        return {} if complete else sample.tenants
    if sample.started != before.epoch:
        return {}
    return sample.tenants if before.tenants is None else before.tenants


def scrape_targets(pods: Iterable[Mapping[str, Any]], readings: Mapping[str, Reading], port: int) -> dict[str, str]:
    """Pod uid -> metrics URL: every ready pod, every terminating one (its final counters), and every pod
    already counted even while it is unready (it keeps serving what it had accepted)."""
    targets = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip, uid = status.get("podIP"), meta.get("uid")
        if ip and uid and (is_ready(pod) or meta.get("deletionTimestamp") or uid in readings):
            targets[str(uid)] = f"http://{ip}:{port}/metrics"
    return targets


def is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(cond.get("type") == "Ready" and cond.get("status") == "True"
                for cond in status.get("conditions") or [])
    return bool(ready and status.get("podIP") and not (pod.get("metadata") or {}).get("deletionTimestamp"))


def stream_mode(samples: Iterable[PodSample]) -> str:
    modes = {s.stream_mode for s in samples}
    if not modes:
        return "unknown"
    return modes.pop() if len(modes) == 1 else "mixed"


def judge(state: UsageState, round_: Round, max_mismatch_ratio: float) -> Verdict:
    """UsageHealthy for this round, with hysteresis (bad at once, good after a clean streak)."""
    raw = _raw_verdict(state, round_, max_mismatch_ratio)
    if raw.status == "True":
        state.good_streak += 1
        if state.unhealthy is not None and state.good_streak < HEALTHY_STREAK:
            return state.unhealthy
        state.unhealthy = None
    else:
        # Unknown (nothing scraped) is no evidence either way: it neither clears nor counts as clean.
        state.good_streak = 0
        if raw.status == "False":
            state.unhealthy = raw
    return raw


def _raw_verdict(state: UsageState, round_: Round, max_mismatch_ratio: float) -> Verdict:
    if not round_.samples:
        return Verdict(c.USAGE_HEALTHY, "Unknown", "NoPodsScraped",
                       f"No pod could be scraped ({len(round_.failed)} failed)")
    cumulative = [uid for uid, s in round_.samples.items() if s.stream_mode != "incremental"]
    if cumulative:
        return Verdict(c.USAGE_HEALTHY, "False", "CumulativeStreaming",
                       f"{len(cumulative)} pod(s) report stream mode other than incremental")
    window = Counters()
    for delta in state.window:
        window = window.plus(delta)
    if window.derived_requests > 0:
        return Verdict(c.USAGE_HEALTHY, "False", "EngineUsageMissing",
                       f"The engine reported no usage for {int(window.derived_requests)} recent request(s)")
    if window.mismatches > 0 and window.mismatches > max_mismatch_ratio * max(window.requests, 1):
        return Verdict(c.USAGE_HEALTHY, "False", "UsageMismatch",
                       f"{int(window.mismatches)} recent choice(s) streamed a different number of tokens than "
                       f"the engine counted ({int(window.requests)} requests)")
    # Drift is read when a pod had nothing in flight; what matters is how it moved within the window
    # (an old disagreement, say one abort long ago, ages out instead of marking the pod for ever).
    moved = [abs(readings[-1] - readings[0]) for uid, readings in state.drifts.items() if uid in round_.samples]
    if moved and max(moved) > max(16.0, 0.01 * window.completion_tokens):
        return Verdict(c.USAGE_HEALTHY, "False", "EngineCounterDrift",
                       f"Completion tokens moved {int(max(moved))} away from SGLang's own counter in the last "
                       f"{len(state.window)} round(s)")
    return Verdict(c.USAGE_HEALTHY, "True", "UsageConsistent",
                   f"Engine usage matches the streamed tokens on {len(round_.samples)} pod(s)")


_STATUS_KEYS = {"requests": "requests", "prompt_tokens": "promptTokens", "completion_tokens": "completionTokens",
                "cached_tokens": "cachedTokens", "mismatches": "mismatches", "derived_requests": "derivedRequests"}


def _counters_status(counters: Counters) -> dict[str, int]:
    return {key: int(getattr(counters, name)) for name, key in _STATUS_KEYS.items()}


def _counters_from(raw: Mapping[str, object]) -> Counters:
    def num(key: str) -> float:
        value = raw.get(key, 0)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    return Counters(**{name: num(key) for name, key in _STATUS_KEYS.items()})


def usage_status(state: UsageState, round_: Round, scraped_at: str) -> dict[str, object]:
    """`status.usage`: the totals and, in the same write, every pod's reading they stand on."""
    pods = [{"uid": uid, "epoch": r.epoch, "final": r.final, **_counters_status(r.counters)}
            if r.epoch is not None else {"uid": uid, "final": r.final, **_counters_status(r.counters)}
            for uid, r in sorted(state.readings.items())]
    return {
        **_counters_status(state.totals),
        "streamMode": stream_mode(round_.samples.values()), "podsScraped": len(round_.samples),
        "podsFailed": len(round_.failed), "podsUnaccounted": state.unaccounted, "lastScrapeTime": scraped_at,
        "pods": pods,
    }


def state_from_status(usage: Mapping[str, object]) -> UsageState:
    """Resume where the last status write left off (an operator restart, or its peer taking over)."""
    readings: dict[str, Reading] = {}
    raw_pods = usage.get("pods")
    for pod in raw_pods if isinstance(raw_pods, list) else []:
        if isinstance(pod, Mapping) and isinstance(pod.get("uid"), str):
            epoch = pod.get("epoch")
            readings[str(pod["uid"])] = Reading(_counters_from(pod), float(epoch) if isinstance(
                epoch, int | float) else None, bool(pod.get("final")))
    unaccounted = usage.get("podsUnaccounted", 0)
    return UsageState(readings=readings, totals=_counters_from(usage),
                      unaccounted=unaccounted if isinstance(unaccounted, int) else 0,
                      complete=not usage or isinstance(raw_pods, list))
