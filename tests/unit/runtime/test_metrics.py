"""The runtime's series: drift against the engine's own totals, and the token histogram's exposition."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tally_runtime.engine.base import Delta, EngineMetrics, FinishReason
from tally_runtime.metrics import TOKEN_BUCKETS, TokenHistogram
from tally_runtime.usage import ChoiceUsage, request_usage


def finished(index: int, prompt_index: int, deltas: list[Delta], prompt_len: int = 99) -> ChoiceUsage:
    usage = ChoiceUsage(index, prompt_index, prompt_len)
    for delta in deltas:
        usage.observe(delta)
    return usage


def sglang_text(prompt: float, generation: float) -> bytes:
    return (b'# TYPE sglang:prompt_tokens counter\n'
            b'sglang:prompt_tokens_total{is_streaming="true"} %.1f\n'
            b'sglang:prompt_tokens_total{is_streaming="false"} 0.0\n'
            b'# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total %.1f\n' % (prompt, generation))


def engine_numbers(prompt: float, generation: float) -> EngineMetrics:
    """What the SGLang adapter reports: its series, and the token totals summed over their label sets."""
    from tally_runtime.engine.sglang_metrics import engine_totals

    text = sglang_text(prompt, generation)
    totals = engine_totals(text.decode())
    assert totals == {"sglang:prompt_tokens_total": prompt, "sglang:generation_tokens_total": generation}
    return EngineMetrics(text, totals["sglang:prompt_tokens_total"], totals["sglang:generation_tokens_total"])


def test_drift_against_sglang_counters_counts_the_prompt_per_choice() -> None:
    from tally_runtime.metrics import Metrics

    metrics = Metrics()
    # one request, n=2 on a 5-token prompt: billed once (5), but SGLang ran two requests and counted 10
    two = [finished(i, 0, [Delta(token_ids=(1,) * 15, prompt_tokens=5, completion_tokens=15,
                                 finish_reason=FinishReason.LENGTH)]) for i in range(2)]
    metrics.record_usage(request_usage(two))
    text = metrics.render(engine_numbers(10, 25)).decode()
    assert 'tally_engine_usage_drift_tokens{kind="prompt"} 0.0' in text
    assert 'tally_engine_usage_drift_tokens{kind="completion"} 5.0' in text
    assert text.endswith(sglang_text(10, 25).decode())


def test_drift_is_only_taken_when_settled() -> None:
    """SGLang counts a request before its last item reaches us: mid-request readings are not drift."""
    from tally_runtime.metrics import Metrics

    metrics = Metrics()
    metrics.render(engine_numbers(0, 0))
    text = metrics.render(engine_numbers(4, 8), settled=False).decode()  # finished in SGLang, not yet here
    assert 'tally_engine_usage_drift_tokens{kind="completion"} 0.0' in text


def test_token_histogram_exposes_what_prometheus_histogram_does() -> None:
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("x_seconds", "doc", buckets=TOKEN_BUCKETS, registry=theirs_registry)
    ours = TokenHistogram("x_seconds", "doc", TOKEN_BUCKETS, registry=ours_registry)
    rng = random.Random(1)
    values = [*TOKEN_BUCKETS, 0.0, 1e-9, 99.0] + [rng.random() / 10 for _ in range(200)]
    for value in values:
        theirs.observe(value)
        ours.observe(value)
    for _ in range(5):  # one call for five equal tokens
        theirs.observe(0.02)
    ours.observe(0.02, 5)

    def samples(registry: CollectorRegistry) -> dict[str, float]:
        lines = generate_latest(registry).decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if not line.startswith("#") and "_created" not in line}

    expected, got = samples(theirs_registry), samples(ours_registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert got['x_seconds_bucket{le="0.02"}'] > got['x_seconds_bucket{le="0.01"}']


def test_counters_export_no_created_series() -> None:
    """Each counter once: a `_created` series per counter would double what every pod exports."""
    from tally_runtime.metrics import Metrics

    metrics = Metrics()
    metrics.record_request("completions", "ok", "length")
    text = metrics.render().decode()
    assert "tally_requests_total{" in text and "_created" not in text
