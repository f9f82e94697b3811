"""Reading a runtime's /metrics text: finished requests, final readings, per-tenant counters."""

from __future__ import annotations

import pytest

from tally_operator.samples import Counters, MetricsParseError, PodSample, parse_sample

METRICS = """# TYPE tally_requests counter
tally_requests_total{endpoint="completions",outcome="ok",finish_reason="length"} 4
tally_requests_total{endpoint="completions",outcome="invalid",finish_reason="none"} 7
# TYPE tally_prompt_tokens counter
tally_prompt_tokens_total 40
# TYPE tally_completion_tokens counter
tally_completion_tokens_total 64
# TYPE tally_usage_mismatches counter
tally_usage_mismatches_total 0
# TYPE tally_stream_mode gauge
tally_stream_mode{mode="incremental"} 1
tally_stream_mode{mode="cumulative"} 0
"""


def sample(completion: float, mismatches: float = 0, mode: str = "incremental") -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion, mismatches=mismatches), mode)


def test_parse_sample_counts_finished_requests_only() -> None:
    sample = parse_sample(METRICS)
    assert sample.counters.requests == 4 and sample.counters.completion_tokens == 64
    assert sample.stream_mode == "incremental"
    with pytest.raises(MetricsParseError):
        parse_sample("garbage {{{")
    with pytest.raises(MetricsParseError):
        parse_sample("# TYPE other counter\nother_total 1\n")


def test_a_draining_idle_runtime_reports_final_counters() -> None:
    base = ("# TYPE tally_requests counter\ntally_requests_total{endpoint=\"completions\",outcome=\"ok\","
            "finish_reason=\"length\"} 3.0\n# TYPE tally_draining gauge\ntally_draining %s\n"
            "# TYPE tally_inflight_generations gauge\ntally_inflight_generations %s\n")
    assert parse_sample(base % ("1.0", "0.0")).final
    assert not parse_sample(base % ("1.0", "2.0")).final  # still finishing streams
    assert not parse_sample(base % ("0.0", "0.0")).final


def test_tenant_counters_are_parsed_per_label() -> None:
    text = ("# TYPE tally_requests counter\n"
            "tally_requests_total{endpoint=\"chat\",outcome=\"ok\",finish_reason=\"stop\"} 3\n"
            "# TYPE tally_tenant_completion_tokens counter\n"
            "tally_tenant_completion_tokens_total{tenant=\"team-a\"} 40\n"
            "tally_tenant_completion_tokens_total{tenant=\"other\"} 2\n"
            "# TYPE tally_tenant_requests counter\ntally_tenant_requests_total{tenant=\"team-a\"} 3\n")
    tenants = parse_sample(text).tenants
    assert tenants["team-a"] == Counters(requests=3, completion_tokens=40)
    assert tenants["other"].completion_tokens == 2
