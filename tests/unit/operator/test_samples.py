"""Reading a runtime's /metrics text: served requests, final readings, per-tenant counters, and refusing
what cannot be trusted (another pod, no epoch, non-finite or negative numbers, unbounded tenants)."""

from __future__ import annotations

import pytest

from tally_operator.samples import MAX_TENANTS_PER_POD, Counters, MetricsParseError, parse_sample

EPOCH = "# TYPE tally_start_time_seconds gauge\ntally_start_time_seconds 1.7e9\n"
POD = "# TYPE tally_runtime_info gauge\ntally_runtime_info{pod_uid=\"uid-1\"} 1\n"
METRICS = EPOCH + POD + """# TYPE tally_requests counter
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
# TYPE tally_tenant_requests counter
tally_tenant_requests_total{tenant="team-a"} 4
# TYPE tally_tenant_prompt_tokens counter
tally_tenant_prompt_tokens_total{tenant="team-a"} 40
# TYPE tally_tenant_completion_tokens counter
tally_tenant_completion_tokens_total{tenant="team-a"} 64
"""
REQUESTS = ("# TYPE tally_requests counter\n"
            "tally_requests_total{endpoint=\"chat\",outcome=\"ok\",finish_reason=\"stop\"} 3\n"
            "# TYPE tally_tenant_requests counter\ntally_tenant_requests_total{tenant=\"team-a\"} 3\n")


def test_parse_sample_counts_served_requests_and_keeps_all_for_the_handshake() -> None:
    sample = parse_sample(METRICS, expected_pod_uid="uid-1")
    assert sample.counters.requests == 4 and sample.counters.completion_tokens == 64
    assert sample.all_requests == 11 and sample.started == 1.7e9 and sample.stream_mode == "incremental"
    assert sample.acknowledgement() == {"epoch": 1.7e9, "requests": 11, "promptTokens": 40, "completionTokens": 64,
                                        "cachedTokens": 0}


@pytest.mark.parametrize(("text", "expected_uid", "why"), [
    pytest.param("garbage {{{", None, "not Prometheus text", id="garbage"),
    pytest.param(EPOCH + "# TYPE other counter\nother_total 1\n", None, "no Tally usage", id="not-tally"),
    pytest.param(REQUESTS, None, "epoch is unknown", id="no-epoch"),
    pytest.param(METRICS, "uid-2", "not 'uid-2'", id="another-pod-on-a-reused-ip"),
    pytest.param(EPOCH + REQUESTS + "# TYPE tally_completion_tokens counter\ntally_completion_tokens_total NaN\n",
                 None, "finite", id="nan"),
    pytest.param(EPOCH + REQUESTS + "# TYPE tally_prompt_tokens counter\ntally_prompt_tokens_total +Inf\n",
                 None, "finite", id="infinite"),
    pytest.param(EPOCH + REQUESTS + "# TYPE tally_prompt_tokens counter\ntally_prompt_tokens_total -5\n",
                 None, "not negative", id="negative"),
    pytest.param(EPOCH + REQUESTS + "# TYPE tally_tenant_prompt_tokens counter\n"
                 "tally_tenant_prompt_tokens_total{tenant=\"a\"} -1\n", None, "not negative", id="negative-tenant"),
    pytest.param(EPOCH + REQUESTS + "# TYPE tally_queued_requests gauge\n"
                 "tally_queued_requests{a=\"1\"} 1e308\ntally_queued_requests{a=\"2\"} 1e308\n",
                 None, "autoscaling signal", id="load-summing-to-infinity"),
    pytest.param(EPOCH + REQUESTS + "# TYPE tally_inflight_generations gauge\ntally_inflight_generations 5e9\n",
                 None, "autoscaling signal", id="load-beyond-any-pod"),
])
def test_untrusted_samples_are_refused_whole(text: str, expected_uid: str | None, why: str) -> None:
    with pytest.raises(MetricsParseError, match=why):
        parse_sample(text, expected_pod_uid=expected_uid)


def test_a_draining_idle_runtime_reports_final_counters() -> None:
    base = (EPOCH + REQUESTS + "# TYPE tally_draining gauge\ntally_draining %s\n"
            "# TYPE tally_inflight_generations gauge\ntally_inflight_generations %s\n")
    assert parse_sample(base % ("1.0", "0.0")).final
    assert not parse_sample(base % ("1.0", "2.0")).final  # still finishing streams
    assert not parse_sample(base % ("0.0", "0.0")).final


def test_tenant_counters_are_parsed_per_label() -> None:
    text = (EPOCH + "# TYPE tally_requests counter\n"
            "tally_requests_total{endpoint=\"chat\",outcome=\"ok\",finish_reason=\"stop\"} 4\n"
            "# TYPE tally_completion_tokens counter\ntally_completion_tokens_total 42\n"
            "# TYPE tally_tenant_completion_tokens counter\n"
            "tally_tenant_completion_tokens_total{tenant=\"team-a\"} 40\n"
            "tally_tenant_completion_tokens_total{tenant=\"other\"} 2\n"
            "# TYPE tally_tenant_requests counter\ntally_tenant_requests_total{tenant=\"team-a\"} 3\n"
            "tally_tenant_requests_total{tenant=\"other\"} 1\n")
    tenants = parse_sample(text).tenants
    assert tenants["team-a"] == Counters(requests=3, completion_tokens=40)
    assert tenants["other"] == Counters(requests=1, completion_tokens=2)


def test_tenants_that_do_not_sum_to_the_totals_are_refused() -> None:
    """The ledger books tenants from the same readings as the totals: a pod whose tenants disagree is refused."""
    with pytest.raises(MetricsParseError, match="do not sum"):
        parse_sample(METRICS.replace('tally_tenant_completion_tokens_total{tenant="team-a"} 64',
                                     'tally_tenant_completion_tokens_total{tenant="team-a"} 63'))
    with pytest.raises(MetricsParseError, match="do not sum"):
        parse_sample(METRICS + '# TYPE tally_tenant_cached_tokens counter\n'
                               'tally_tenant_cached_tokens_total{tenant="team-b"} 1\n')


def test_more_tenants_than_a_pod_may_report_are_refused() -> None:
    """No fold by name here: which names a fold keeps would shift as tenants come and go (the ledger's own
    bound is sticky, usage.py); a runtime keeps --max-tenants (100), so a pod with over 1000 is not ours."""
    count = MAX_TENANTS_PER_POD + 2
    lines = "".join(f"tally_tenant_requests_total{{tenant=\"t{i:05d}\"}} 1\n" for i in range(count))
    text = (EPOCH + "# TYPE tally_requests counter\n"
            f"tally_requests_total{{endpoint=\"chat\",outcome=\"ok\",finish_reason=\"stop\"}} {count}\n"
            "# TYPE tally_tenant_requests counter\n" + lines)
    with pytest.raises(MetricsParseError, match="tenants: more than"):
        parse_sample(text)
    assert len(parse_sample(text.replace('tally_tenant_requests_total{tenant="t00000"} 1\n', "").replace(
        f"}} {count}\n", f"}} {count - 1}\n", 1)).tenants) == MAX_TENANTS_PER_POD + 1


@pytest.mark.parametrize(("line", "why"), [
    pytest.param("tally_completion_tokens_total 1e19", "no larger than 2\\^53", id="above-int64"),
    pytest.param("tally_completion_tokens_total 1e300", "no larger than 2\\^53", id="far-above"),
    pytest.param("tally_completion_tokens_total 10.5", "whole number", id="fractional"),
    pytest.param('tally_tenant_prompt_tokens_total{tenant="a"} 0.25', "whole number", id="fractional-tenant"),
])
def test_counts_that_no_pod_can_have_are_refused_whole(line: str, why: str) -> None:
    """A counter of 1e19 is finite and not negative, but the status write would carry an integer the API
    server refuses, and every later pass, for every pod, would fail the same way."""
    with pytest.raises(MetricsParseError, match=why):
        parse_sample(METRICS + line + "\n", expected_pod_uid="uid-1")


def test_counters_summed_over_label_sets_above_2_to_the_53_are_refused() -> None:
    big = 2**52
    lines = "".join(f'tally_requests_total{{endpoint="e{i}",outcome="ok",finish_reason="stop"}} {big}\n'
                    for i in range(3))
    with pytest.raises(MetricsParseError, match="2\\^53"):
        parse_sample(EPOCH + POD + "# TYPE tally_requests counter\n" + lines, expected_pod_uid="uid-1")


def test_budget_refusals_and_tenants_asking_for_a_lease_are_read_per_tenant() -> None:
    text = (METRICS + "# TYPE tally_budget_refusals counter\n"
            'tally_budget_refusals_total{tenant="acme",code="insufficient_quota"} 3\n'
            'tally_budget_refusals_total{tenant="acme",code="rate_limit_exceeded"} 2\n'
            "# TYPE tally_budget_wanted_tokens gauge\n"
            'tally_budget_wanted_tokens{tenant="newbie"} 40\ntally_budget_wanted_tokens{tenant="done"} 0\n')
    sample = parse_sample(text)
    assert sample.refusals == {"acme": 5} and sample.wanted == {"newbie": 40}
    with pytest.raises(MetricsParseError, match="not negative"):
        parse_sample(METRICS + '# TYPE tally_budget_wanted_tokens gauge\ntally_budget_wanted_tokens{tenant="x"} -1\n')


def test_what_a_pod_may_reach_under_its_leases_is_read_with_the_message_number_and_bounded() -> None:
    text = (METRICS + "# TYPE tally_budget_lease_sequence gauge\ntally_budget_lease_sequence 1764936000123\n"
            "# TYPE tally_budget_allowance_tokens gauge\n"
            'tally_budget_allowance_tokens{tenant="acme"} 450.5\ntally_budget_allowance_tokens{tenant="zeta"} 0\n')
    sample = parse_sample(text)
    assert sample.lease_seq == 1764936000123 and sample.reach == {"acme": 451, "zeta": 0}  # rounded up
    for bad, why in (("tally_budget_lease_sequence 1.5", "whole number"), ("tally_budget_lease_sequence -1", "not neg"),
                     ('tally_budget_allowance_tokens{tenant="a"} NaN', "finite")):
        with pytest.raises(MetricsParseError, match=why):
            parse_sample(METRICS + f"# TYPE {bad.split()[0].split('{')[0]} gauge\n{bad}\n")
    many = "".join(f'tally_budget_allowance_tokens{{tenant="t{i}"}} 1\n' for i in range(2001))
    with pytest.raises(MetricsParseError, match="tenants in the budget series"):
        parse_sample(METRICS + "# TYPE tally_budget_allowance_tokens gauge\n" + many)
