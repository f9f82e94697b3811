"""PURE: scraped runtime metrics -> per-service usage totals and a usage-health verdict.

Counters are read per pod; the operator keeps each pod's last values and adds only the increase, so a
restarted pod (its counters back at zero) is new usage, never negative usage. The verdict looks at a
window of recent rounds and has hysteresis: it turns unhealthy at once, and healthy again only after
several clean rounds in a row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families

from tally_operator import constants as c
from tally_operator.conditions import Verdict
from tally_runtime import metric_names as m

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

    def minus(self, other: Counters) -> Counters:
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
    started: float | None = None  # the runtime process's start time: a new value means its counters reset


_COUNTER_NAMES = {
    m.sample_name(m.REQUESTS): "requests",
    m.sample_name(m.PROMPT_TOKENS): "prompt_tokens",
    m.sample_name(m.COMPLETION_TOKENS): "completion_tokens",
    m.sample_name(m.CACHED_TOKENS): "cached_tokens",
    m.sample_name(m.USAGE_MISMATCHES): "mismatches",
    m.sample_name(m.DERIVED_USAGE_REQUESTS): "derived_requests",
}


class MetricsParseError(ValueError):
    pass


def parse_sample(text: str) -> PodSample:
    """Read a runtime's /metrics text. Requests count only finished ones (not invalid or overloaded)."""
    values = dict.fromkeys(_COUNTER_NAMES.values(), 0.0)
    modes: dict[str, float] = {}
    drift: float | None = None
    started: float | None = None
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = _COUNTER_NAMES.get(sample.name)
                if name == "requests" and sample.labels.get("outcome") in {m.OUTCOME_INVALID, m.OUTCOME_OVERLOADED}:
                    continue
                if name is not None:
                    values[name] += sample.value
                    seen = True
                elif sample.name == m.STREAM_MODE:
                    modes[sample.labels.get("mode", "")] = sample.value
                elif sample.name == m.ENGINE_USAGE_DRIFT and sample.labels.get("kind") == "completion":
                    drift = sample.value
                elif sample.name == m.START_TIME:
                    started = sample.value
    except (ValueError, TypeError, KeyError) as err:
        raise MetricsParseError(f"not Prometheus text: {err}") from None
    if not seen:
        raise MetricsParseError("no Tally usage series in the response")
    mode = next((k for k, v in modes.items() if v == 1), "unknown")
    return PodSample(Counters(**values), mode, drift, started)


@dataclass
class UsageState:
    """What the operator remembers per service between rounds (kept in kopf's per-object memo)."""

    last: dict[str, Counters] = field(default_factory=dict)  # pod uid -> last counters
    started: dict[str, float | None] = field(default_factory=dict)  # pod uid -> its runtime's start time
    totals: Counters = field(default_factory=Counters)
    window: deque[Counters] = field(default_factory=lambda: deque(maxlen=WINDOW_ROUNDS))
    # pod uid -> its recent drift readings (this incarnation): only a change within the window counts
    drifts: dict[str, deque[float]] = field(default_factory=dict)
    good_streak: int = 0
    unhealthy: Verdict | None = None  # the last definite verdict, when False: True needs a clean streak


@dataclass(frozen=True, slots=True)
class Round:
    samples: Mapping[str, PodSample]  # pod uid -> sample, for pods scraped successfully
    failed: frozenset[str] = frozenset()  # pod uids that could not be scraped
    new_pods: frozenset[str] = frozenset()  # pods to count from zero (created after we started watching)


def absorb(state: UsageState, round_: Round) -> Counters:
    """Add this round's increases to the totals; returns the round's increase."""
    increase = Counters()
    for uid, sample in round_.samples.items():
        before = state.last.get(uid)
        if before is None and uid not in round_.new_pods:
            before = sample.counters  # seen first after a restart of ours: a baseline, not new usage
        elif before is not None and sample.started != state.started.get(uid):
            # The runtime restarted: all of its counters are new, even where they already climbed past
            # the old values (a decrease alone would miss that).
            before = Counters()
        delta = sample.counters.minus(before or Counters())
        increase = increase.plus(delta)
        if uid in state.started and sample.started != state.started[uid]:
            state.drifts.pop(uid, None)  # a new incarnation starts its drift afresh
        if sample.completion_drift is not None:
            state.drifts.setdefault(uid, deque(maxlen=WINDOW_ROUNDS)).append(sample.completion_drift)
        state.last[uid] = sample.counters
        state.started[uid] = sample.started
    for gone in set(state.last) - set(round_.samples) - set(round_.failed):
        del state.last[gone]  # the pod is gone; a failed scrape keeps its last values
        state.started.pop(gone, None)
        state.drifts.pop(gone, None)
    state.totals = state.totals.plus(increase)
    state.window.append(increase)
    return increase


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


def usage_status(state: UsageState, round_: Round, scraped_at: str) -> dict[str, object]:
    t = state.totals
    return {
        "requests": int(t.requests), "promptTokens": int(t.prompt_tokens),
        "completionTokens": int(t.completion_tokens), "cachedTokens": int(t.cached_tokens),
        "mismatches": int(t.mismatches), "derivedRequests": int(t.derived_requests),
        "streamMode": stream_mode(round_.samples.values()), "podsScraped": len(round_.samples),
        "podsFailed": len(round_.failed), "lastScrapeTime": scraped_at,
    }


def totals_from_status(usage: Mapping[str, object]) -> Counters:
    """Resume totals from a status written before an operator restart."""
    def num(key: str) -> float:
        value = usage.get(key, 0)
        return float(value) if isinstance(value, int | float) else 0.0

    return Counters(num("requests"), num("promptTokens"), num("completionTokens"), num("cachedTokens"),
                    num("mismatches"), num("derivedRequests"))
