"""Pure status: conditions bookkeeping, verdicts from the Deployment and pods, usage deltas and health."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator.conditions import Verdict, set_condition, transitions
from tally_operator.spec import parse_spec
from tally_operator.status import build_status, without_times, workload_verdicts
from tally_operator.usage import (
    Counters,
    MetricsParseError,
    PodSample,
    Reading,
    Round,
    UsageState,
    absorb,
    judge,
    parse_sample,
    scrape_targets,
    state_from_status,
    usage_status,
)

SPEC = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}, "replicas": 2})


def deployment(ready: int, updated: int = 2, replicas: int = 2, **conditions: str) -> dict[str, Any]:
    return {"metadata": {"generation": 3}, "status": {
        "observedGeneration": 3, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
        "conditions": [{"type": k, "status": "True", "reason": v} for k, v in conditions.items()]}}


def by_type(verdicts: list[Verdict]) -> dict[str, Verdict]:
    return {v.type: v for v in verdicts}


def test_transition_time_moves_only_on_a_flip() -> None:
    first = set_condition([], Verdict("Ready", "False", "WaitingForPods", "0 of 2"), "t1", 1)
    same = set_condition(first, Verdict("Ready", "False", "WaitingForPods", "1 of 2"), "t2", 1)
    flipped = set_condition(same, Verdict("Ready", "True", "AllReplicasReady", "2 of 2"), "t3", 2)
    assert same[0]["lastTransitionTime"] == "t1" and flipped[0]["lastTransitionTime"] == "t3"
    assert flipped[0]["observedGeneration"] == 2
    assert [c["type"] for c in transitions(first, flipped)] == ["Ready"]
    assert transitions(first, same) == []


@pytest.mark.parametrize(("dep", "pods", "ready", "progressing"), [
    pytest.param(deployment(2), [], ("True", "AllReplicasReady"), ("False", "Stable"), id="ready"),
    pytest.param(deployment(1), [], ("False", "WaitingForPods"), ("True", "RollingOut"), id="rolling"),
    pytest.param(None, [], ("False", "WaitingForPods"), ("True", "RollingOut"), id="no-deployment-yet"),
    pytest.param(deployment(0, 0), [{"status": {"conditions": [{"type": "PodScheduled", "reason": "Unschedulable",
                 "message": "0/2 nodes: Insufficient nvidia.com/gpu"}]}}], ("False", "Unschedulable"),
                 ("True", "Unschedulable"), id="no-gpus"),
])
def test_workload_verdicts(dep: dict[str, Any] | None, pods: list[dict[str, Any]], ready: tuple[str, str],
                           progressing: tuple[str, str]) -> None:
    verdicts = by_type(workload_verdicts(SPEC, dep, pods))
    assert (verdicts["Ready"].status, verdicts["Ready"].reason) == ready
    assert (verdicts["Progressing"].status, verdicts["Progressing"].reason) == progressing


def test_degraded_on_deadline() -> None:
    verdicts = by_type(workload_verdicts(SPEC, deployment(1, Progressing="ProgressDeadlineExceeded"), []))
    assert verdicts["Degraded"].status == "True"


def test_build_status_keeps_usage_and_orders_conditions() -> None:
    previous = {"usage": {"requests": 3}, "conditions": [{"type": "UsageHealthy", "status": "True", "reason": "x",
                                                         "message": "", "lastTransitionTime": "t0"}]}
    status = build_status(previous, workload_verdicts(SPEC, deployment(2), []), "t1", 3, {"replicas": 2})
    assert status["usage"] == {"requests": 3} and status["observedGeneration"] == 3
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "UsageHealthy"]
    assert without_times(status) == without_times(build_status(status, [], "t9", 3, {"replicas": 2}))


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


def test_parse_sample_counts_finished_requests_only() -> None:
    sample = parse_sample(METRICS)
    assert sample.counters.requests == 4 and sample.counters.completion_tokens == 64
    assert sample.stream_mode == "incremental"
    with pytest.raises(MetricsParseError):
        parse_sample("garbage {{{")
    with pytest.raises(MetricsParseError):
        parse_sample("# TYPE other counter\nother_total 1\n")


def sample(completion: float, mismatches: float = 0, mode: str = "incremental") -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion, mismatches=mismatches), mode)


def test_counter_reset_is_new_usage_not_negative() -> None:
    state = UsageState()
    absorb(state, Round({"a": sample(100)}))
    absorb(state, Round({"a": sample(140)}))
    absorb(state, Round({"a": sample(12)}))  # the pod restarted: its counters began again at zero
    assert state.totals.completion_tokens == 152


def test_pods_seen_first_after_an_upgrade_from_a_status_without_readings_are_a_baseline() -> None:
    state = state_from_status({"requests": 125, "completionTokens": 500})  # written by an older operator
    absorb(state, Round({"old": sample(300)}))  # already counted before the restart
    absorb(state, Round({"old": sample(320), "new": sample(8)}))
    assert state.totals.completion_tokens == 500 + 20 + 8


def test_health_hysteresis_and_reasons() -> None:
    state = UsageState()
    bad = Round({"a": sample(40, mismatches=1)})
    absorb(state, bad)
    assert judge(state, bad, 0.0).reason == "UsageMismatch"
    for _ in range(10):  # the window of recent rounds slides past the mismatch
        clean = Round({"a": sample(40, mismatches=1)})
        absorb(state, clean)
    assert judge(state, clean, 0.0).status == "False"  # hysteresis: one clean round is not enough
    assert judge(state, clean, 0.0).status == "True"
    cumulative = Round({"a": sample(40, mismatches=1, mode="cumulative")})
    absorb(state, cumulative)
    assert judge(state, cumulative, 0.0).reason == "CumulativeStreaming"
    first_good = Round({"a": sample(40, mismatches=1)})
    absorb(state, first_good)
    assert judge(state, first_good, 0.0).status == "False"  # one clean round is not enough
    absorb(state, first_good)
    assert judge(state, first_good, 0.0).status == "True"
    assert judge(UsageState(), Round({}, failed=frozenset({"x"})), 0.0).status == "Unknown"


def test_restart_detected_by_start_time_even_when_counters_climbed_past() -> None:
    state = UsageState()
    absorb(state, Round({"a": PodSample(Counters(completion_tokens=12), "incremental", None, 100.0)}))
    # the runtime restarted and served 14 tokens before the next scrape: more than before, yet all new
    absorb(state, Round({"a": PodSample(Counters(completion_tokens=14), "incremental", None, 200.0)}))
    assert state.totals.completion_tokens == 26


def test_an_unknown_round_does_not_skip_the_healthy_streak() -> None:
    state = UsageState()
    bad = Round({"a": sample(40, mismatches=1)})
    absorb(state, bad)
    assert judge(state, bad, 0.0).status == "False"
    for _ in range(10):  # the mismatch slides out of the window
        absorb(state, Round({"a": sample(40, mismatches=1)}))
    nothing = Round({}, failed=frozenset({"a"}))
    absorb(state, nothing)
    assert judge(state, nothing, 0.0).status == "Unknown"
    clean = Round({"a": sample(40, mismatches=1)})
    absorb(state, clean)
    assert judge(state, clean, 0.0).status == "False"  # one clean round after Unknown is still not enough
    absorb(state, clean)
    assert judge(state, clean, 0.0).status == "True"


def drifted(completion: float, drift: float) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion), "incremental", drift, 1.0)


def test_an_old_drift_ages_out_while_a_growing_one_is_caught() -> None:
    state = UsageState()
    old = Round({"a": drifted(400, -397)})  # one abandoned request long ago
    absorb(state, old)
    assert judge(state, old, 0.0).status == "True"  # a constant offset is not a trend
    for _ in range(3):
        steady = Round({"a": drifted(400, -397)})
        absorb(state, steady)
        assert judge(state, steady, 0.0).status == "True"
    growing = Round({"a": drifted(800, -397 - 40)})  # now it moves: SGLang counts what we did not
    absorb(state, growing)
    verdict = judge(state, growing, 0.0)
    assert (verdict.status, verdict.reason) == ("False", "EngineCounterDrift")
    for _ in range(10):
        absorb(state, Round({"a": drifted(800, -437)}))
    settled = Round({"a": drifted(800, -437)})
    absorb(state, settled)
    judge(state, settled, 0.0)
    assert judge(state, settled, 0.0).status == "True"  # the move left the window


def test_a_restarted_runtime_starts_its_drift_afresh() -> None:
    state = UsageState()
    absorb(state, Round({"a": PodSample(Counters(completion_tokens=10), "incremental", -300.0, 1.0)}))
    restarted = Round({"a": PodSample(Counters(completion_tokens=10), "incremental", 0.0, 2.0)})
    absorb(state, restarted)
    assert judge(state, restarted, 0.0).status == "True"


def at(completion: float, epoch: float = 1.0, final: bool = False) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion), "incremental", None, epoch, final)


def test_a_pod_unready_for_a_round_keeps_its_reading() -> None:
    """It was dropped and counted from zero again: a pod at 1000 that came back at 1200 added 1200."""
    state = UsageState()
    absorb(state, Round({"a": at(1000)}, present=frozenset({"a"})))
    absorb(state, Round({}, present=frozenset({"a"})))  # unready: not scraped, still listed
    absorb(state, Round({"a": at(1200)}, present=frozenset({"a"})))
    assert state.totals.completion_tokens == 1200 and state.unaccounted == 0


def test_a_new_pod_is_known_by_its_uid_not_by_clocks() -> None:
    state = UsageState()
    absorb(state, Round({"a": at(40)}))
    absorb(state, Round({"a": at(40), "b": at(8)}))  # b: never read before, so all of it is new
    assert state.totals.completion_tokens == 48


def test_a_pod_gone_after_its_final_read_is_exact_and_one_gone_before_is_unaccounted() -> None:
    state = UsageState()
    absorb(state, Round({"a": at(10), "b": at(10)}))
    absorb(state, Round({"a": at(30, final=True), "b": at(12)}))  # a drained and was read a last time
    absorb(state, Round({}, present=frozenset()))  # both are gone
    assert state.totals.completion_tokens == 42
    assert state.unaccounted == 1 and state.readings == {}


def test_new_counters_under_the_same_pod_are_new_usage_and_the_lost_tail_is_unaccounted() -> None:
    state = UsageState()
    absorb(state, Round({"a": at(100, epoch=1.0)}))
    absorb(state, Round({"a": at(30, epoch=2.0)}))  # restarted without its journal
    assert state.totals.completion_tokens == 130 and state.unaccounted == 1


def test_a_restarted_operator_continues_exactly_from_the_status() -> None:
    before = UsageState()
    absorb(before, Round({"a": at(100), "b": at(40)}))
    written = usage_status(before, Round({"a": at(100), "b": at(40)}), "t")
    assert [p["uid"] for p in written["pods"]] == ["a", "b"]  # type: ignore[index]
    after = state_from_status(written)  # a new process (or the peer) reads the status back
    absorb(after, Round({"a": at(116), "b": at(40), "c": at(8)}))  # served while no operator ran
    assert after.totals.completion_tokens == 140 + 16 + 8
    assert after.totals.requests == (100 + 40) / 4 + 4 + 2


def test_terminating_and_known_unready_pods_are_scraped_new_unready_ones_are_not() -> None:
    def pod(uid: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"uid": uid, **({"deletionTimestamp": "2026-12-03T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "status": {"podIP": f"127.11.0.{len(uid)}", "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}}

    pods = [pod("r", True), pod("tt", True, deleting=True), pod("kkk", False), pod("nnnn", False)]
    targets = scrape_targets(pods, {"kkk": Reading(Counters(), 1.0)}, 8000)
    assert sorted(targets) == ["kkk", "r", "tt"]
    assert targets["tt"] == "http://127.11.0.2:8000/metrics"


def test_a_draining_idle_runtime_reports_final_counters() -> None:
    base = ("# TYPE tally_requests counter\ntally_requests_total{endpoint=\"completions\",outcome=\"ok\","
            "finish_reason=\"length\"} 3.0\n# TYPE tally_draining gauge\ntally_draining %s\n"
            "# TYPE tally_inflight_generations gauge\ntally_inflight_generations %s\n")
    assert parse_sample(base % ("1.0", "0.0")).final
    assert not parse_sample(base % ("1.0", "2.0")).final  # still finishing streams
    assert not parse_sample(base % ("0.0", "0.0")).final


def with_tenants(completion: float, **tenants: float) -> PodSample:
    return PodSample(Counters(completion_tokens=completion), "incremental", None, 1.0, False,
                     {t: Counters(requests=1, completion_tokens=v) for t, v in tenants.items()})


def test_per_tenant_increases_follow_each_pod() -> None:
    state = UsageState()
    absorb(state, Round({"a": with_tenants(10, alpha=10), "b": with_tenants(5, beta=5)}))
    assert {t: c.completion_tokens for t, c in state.tenant_increase.items()} == {"alpha": 10, "beta": 5}
    absorb(state, Round({"a": with_tenants(18, alpha=12, beta=6), "b": with_tenants(5, beta=5)}))
    assert {t: c.completion_tokens for t, c in state.tenant_increase.items()} == {"alpha": 2, "beta": 6}


def test_after_an_operator_restart_tenant_counters_take_a_new_baseline() -> None:
    before = UsageState()
    absorb(before, Round({"a": with_tenants(10, alpha=10)}))
    after = state_from_status(usage_status(before, Round({}), "t"))
    absorb(after, Round({"a": with_tenants(14, alpha=14)}))
    assert after.totals.completion_tokens == 14  # the totals are exact across the restart
    assert after.tenant_increase["alpha"].completion_tokens == 0  # the per-tenant series re-baseline


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
