"""The autoscaling decision as a table: signal histories (and the pods' state) -> replicas and why."""

from __future__ import annotations

import pytest

from tally_operator.autoscale import Autoscaling, Decision, Observation, Recommendation, decide, deletion_cost
from tally_operator.samples import MAX_LOAD
from tally_runtime import contract

CONFIG = Autoscaling(min_replicas=1, max_replicas=8, metric="queuedRequests", target=4.0,
                     stable_window_seconds=100, panic_window_seconds=10, scale_down_delay_seconds=200,
                     max_scale_up_rate=2.0)
NOW = 1000.0


def flat(value: float, seconds: float = 100, step: float = 2) -> list[Observation]:
    return [Observation(NOW - seconds + step * i, value) for i in range(1, int(seconds / step) + 1)]


def burst(base: float, peak: float) -> list[Observation]:
    """A quiet stable window with a burst in its last 10 seconds."""
    return [Observation(o.at, peak if o.at > NOW - 10 else base) for o in flat(base)]


def run(history: list[Observation], current: int, ready: int | None = None, unschedulable: bool = False,
        recommendations: list[Recommendation] | None = None, since: float = 0.0) -> Decision:
    return decide(CONFIG, history, recommendations or [], current, current if ready is None else ready,
                  unschedulable, NOW, since)


@pytest.mark.parametrize(("history", "current", "ready", "unschedulable", "replicas", "reason"), [
    pytest.param([], 3, 3, False, 3, "NoSignal", id="no-signal-keeps-the-pods"),
    pytest.param(flat(8), 2, 2, False, 2, "Steady", id="at-target"),
    pytest.param(flat(12), 2, 2, False, 3, "ScaleUp", id="above-target-grows"),
    pytest.param(flat(40), 2, 2, False, 4, "Panic", id="growth-bounded-to-2x-per-step"),
    pytest.param(flat(400), 4, 4, False, 8, "Panic", id="bounded-by-max-replicas"),
    pytest.param(flat(400), 8, 8, False, 8, "AtMax", id="at-max"),
    pytest.param(burst(4, 40), 1, 1, False, 2, "Panic", id="a-burst-panics-through-the-stable-average"),
    pytest.param(flat(12), 2, 1, False, 2, "PodsStarting", id="starting-pods-are-capacity-coming"),
    pytest.param(flat(40), 2, 1, False, 4, "Panic", id="a-panic-grows-while-pods-start"),
    pytest.param(flat(40), 3, 2, True, 3, "CapacityUnavailable", id="no-gpu-free-stops-growth"),
    pytest.param(flat(0), 4, 4, False, 4, "Steady", id="scale-down-waits-for-the-delay"),
    pytest.param(flat(40), 9, 9, False, 8, "Bounds", id="max-lowered-below-the-pods-applies-at-once"),
])
def test_decisions(history: list[Observation], current: int, ready: int, unschedulable: bool, replicas: int,
                   reason: str) -> None:
    decision = run(history, current, ready, unschedulable, since=NOW - 10)  # a memory younger than the delay
    assert (decision.replicas, decision.reason) == (replicas, reason), decision.message


def test_a_scale_down_comes_once_every_recommendation_over_the_delay_was_lower() -> None:
    old = [Recommendation(NOW - 150, 3), Recommendation(NOW - 50, 2)]
    decision = run(flat(0), 4, recommendations=old)
    assert (decision.replicas, decision.reason) == (3, "ScaleDown")  # to the highest within the delay
    assert run(flat(0), 4, recommendations=[Recommendation(NOW - 50, 4)]).reason == "Steady"
    quiet = [Recommendation(NOW - 150, 1)]
    assert (run(flat(0), 4, recommendations=quiet).replicas, run(flat(0), 4, recommendations=quiet).reason) == \
        (2, "ScaleDown")  # one pod was enough, but a step removes at most half


def test_panic_never_scales_down_and_min_replicas_holds() -> None:
    assert run(burst(0, 40), 4).replicas >= 4
    assert run(flat(0), 1, recommendations=[Recommendation(NOW - 150, 1)]).replicas == 1


def test_a_noisy_load_causes_fewer_scale_events_than_a_plain_rule() -> None:
    """Bursts every 30 s above a low base: the windows and the delay hold the count where a plain
    ceil(signal / target) rule on the latest reading flaps with every burst."""
    import math

    current, events, plain_current, plain_events = 2, 0, 2, 0
    history: list[Observation] = []
    recommendations: list[Recommendation] = []
    for second in range(0, 900, 2):
        signal = 20.0 if second % 30 < 4 else 2.0
        history = [*history, Observation(second, signal)][-100:]
        decision = decide(CONFIG, history, recommendations, current, current, False, second, 0.0)
        if decision.recommendation is not None:
            recommendations = [*recommendations, decision.recommendation][-200:]
        if decision.replicas != current:
            current, events = decision.replicas, events + 1
        plain = max(1, min(8, math.ceil(signal / CONFIG.target)))
        if plain != plain_current:
            plain_current, plain_events = plain, plain_events + 1
    assert events < plain_events / 4


def test_deletion_cost_is_the_pods_busy_requests_within_the_annotations_int32() -> None:
    assert deletion_cost({}) == 0
    assert deletion_cost({contract.INFLIGHT_GENERATIONS: 3.0, contract.QUEUED_REQUESTS: 2.0}) == 5
    # the largest a trusted sample can say (samples.MAX_LOAD each) still fits the annotation's int32
    assert deletion_cost({contract.QUEUED_REQUESTS: MAX_LOAD, contract.INFLIGHT_GENERATIONS: MAX_LOAD}) < 2**31


def test_a_scale_down_keeps_at_least_half_the_pods_per_step() -> None:
    quiet = [Recommendation(NOW - 150, 1)]
    decision = run(flat(0), 8, recommendations=quiet)
    assert (decision.replicas, decision.reason) == (4, "ScaleDown")


def test_no_scale_down_to_more_pods_than_the_round_read() -> None:
    quiet = [Recommendation(NOW - 150, 1)]
    decision = decide(CONFIG, flat(0), quiet, 4, 4, False, NOW, 0.0, read=1)
    assert (decision.replicas, decision.reason) == (4, "PodsUnread")
    assert decide(CONFIG, flat(0), quiet, 4, 4, False, NOW, 0.0, read=2).replicas == 2


@pytest.mark.parametrize(("target", "rate"), [(1e-308, 2.0), (4.0, 1e308), (5e-324, 1e308)])
def test_every_spec_value_gives_a_decision(target: float, rate: float) -> None:
    """A hostile target or growth rate made math.ceil(inf) raise on every pass (no usage booked again)."""
    config = Autoscaling(min_replicas=1, max_replicas=8, metric="queuedRequests", target=target,
                         max_scale_up_rate=rate, stable_window_seconds=100, panic_window_seconds=10)
    decision = decide(config, flat(40), [], 2, 2, False, NOW, 0.0)
    assert 1 <= decision.replicas <= 8


def test_a_blind_round_is_no_observation_and_an_unread_pod_counts_as_at_target() -> None:
    from tally_operator.autoscale import round_signal

    assert round_signal("queuedRequests", 4.0, [], 4) is None
    assert round_signal("queuedRequests", 4.0, [{contract.QUEUED_REQUESTS: 8.0}], 3) == 8.0 + 3 * 4.0


def test_a_pod_not_read_is_deleted_last() -> None:
    from tally_operator.autoscale import UNREAD_DELETION_COST

    assert deletion_cost(None) == UNREAD_DELETION_COST > deletion_cost({contract.QUEUED_REQUESTS: MAX_LOAD})
