"""Condition bookkeeping: lastTransitionTime moves only on a flip; transitions are what deserve an Event."""

from __future__ import annotations

from tally_operator.conditions import Condition, Verdict, is_bad, set_condition, transitions


def test_transition_time_moves_only_on_a_flip() -> None:
    first = set_condition([], Verdict("Ready", "False", "WaitingForPods", "0 of 2"), "t1", 1)
    same = set_condition(first, Verdict("Ready", "False", "WaitingForPods", "1 of 2"), "t2", 1)
    flipped = set_condition(same, Verdict("Ready", "True", "AllReplicasReady", "2 of 2"), "t3", 2)
    assert same[0]["lastTransitionTime"] == "t1" and flipped[0]["lastTransitionTime"] == "t3"
    assert flipped[0]["observedGeneration"] == 2
    assert [c["type"] for c in transitions(first, flipped)] == ["Ready"]
    assert transitions(first, same) == []


def test_scaling_within_bounds_is_good_news_and_limited_scaling_the_warning() -> None:
    """The review saw ScalingLimited=False posted as a Warning and ScalingLimited=True as Normal."""


    def cond(status: str) -> Condition:
        return {"type": "ScalingLimited", "status": status, "reason": "r", "message": "m",
                "lastTransitionTime": "t", "observedGeneration": 1}

    assert is_bad(cond("True")) and not is_bad(cond("False"))
