"""The UsageHealthy verdict: reasons, hysteresis, and drift judged over a window."""

from __future__ import annotations

from tally_operator.samples import Counters, PodSample
from tally_operator.usage import Round, UsageState, absorb
from tally_operator.verdict import judge


def sample(completion: float, mismatches: float = 0, mode: str = "incremental") -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion, mismatches=mismatches), mode)


def drifted(completion: float, drift: float) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion), "incremental", drift, 1.0)


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
