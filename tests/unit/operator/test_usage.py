"""Usage totals from per-pod readings: resets, restarts, unready and gone pods, persistence, tenants."""

from __future__ import annotations

from typing import Any

from tally_operator.samples import Counters, PodSample
from tally_operator.usage import Reading, Round, UsageState, absorb, scrape_targets, state_from_status, usage_status


def sample(completion: float, mismatches: float = 0, mode: str = "incremental") -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion, mismatches=mismatches), mode)


def at(completion: float, epoch: float = 1.0, final: bool = False) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion), "incremental", None, epoch, final)


def with_tenants(completion: float, **tenants: float) -> PodSample:
    return PodSample(Counters(completion_tokens=completion), "incremental", None, 1.0, False,
                     {t: Counters(requests=1, completion_tokens=v) for t, v in tenants.items()})


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


def test_restart_detected_by_start_time_even_when_counters_climbed_past() -> None:
    state = UsageState()
    absorb(state, Round({"a": PodSample(Counters(completion_tokens=12), "incremental", None, 100.0)}))
    # the runtime restarted and served 14 tokens before the next scrape: more than before, yet all new
    absorb(state, Round({"a": PodSample(Counters(completion_tokens=14), "incremental", None, 200.0)}))
    assert state.totals.completion_tokens == 26


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
