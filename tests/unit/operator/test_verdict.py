"""The UsageHealthy verdict over observations: reasons, hysteresis, drift judged over a window, and
observations that go stale when another writer moved the ledger on."""

from __future__ import annotations

from tally_operator.conditions import Verdict
from tally_operator.observations import Observations, advance, following
from tally_operator.samples import Counters, PodSample
from tally_operator.usage import Ledger, Round, book
from tally_operator.verdict import judge


class Service:
    """One service's ledger and observations, rounds booked as a pass books them."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.observations = Observations()
        self.tenant_increase: dict[str, Counters] = {}

    def round(self, round_: Round) -> Verdict:
        observations = following(self.observations, self.ledger, None)
        booking = book(self.ledger, round_)
        observations = advance(observations, self.ledger, booking, round_)
        self.tenant_increase = dict(booking.tenant_increase)
        verdict, self.observations = judge(observations, round_, 0.0)
        self.ledger = booking.ledger
        return verdict


def sample(completion: float, mismatches: float = 0, mode: str = "incremental", epoch: float = 1.0) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion, mismatches=mismatches), mode,
                     None, epoch)


def drifted(completion: float, drift: float, epoch: float = 1.0) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion), "incremental", drift, epoch)


def with_tenants(completion: float, **tenants: float) -> PodSample:
    return PodSample(Counters(requests=len(tenants), completion_tokens=completion), "incremental", None, 1.0, False,
                     {t: Counters(requests=1, completion_tokens=v) for t, v in tenants.items()})


def test_health_hysteresis_and_reasons() -> None:
    service = Service()
    assert service.round(Round({"a": sample(40, mismatches=1)})).reason == "UsageMismatch"
    verdicts = [service.round(Round({"a": sample(40, mismatches=1)})).status for _ in range(11)]
    assert verdicts[-2:] == ["False", "True"]  # the mismatch slid out of the window; then a clean streak
    assert service.round(Round({"a": sample(40, mismatches=1, mode="cumulative")})).reason == "CumulativeStreaming"
    assert service.round(Round({"a": sample(40, mismatches=1)})).status == "False"  # one clean round: not enough
    assert service.round(Round({"a": sample(40, mismatches=1)})).status == "True"
    assert Service().round(Round({}, failed=frozenset({"x"}))).status == "Unknown"


def test_an_unknown_round_does_not_skip_the_healthy_streak() -> None:
    service = Service()
    assert service.round(Round({"a": sample(40, mismatches=1)})).status == "False"
    for _ in range(10):
        service.round(Round({"a": sample(40, mismatches=1)}))
    assert service.round(Round({}, failed=frozenset({"a"}), present=frozenset({"a"}))).status == "Unknown"
    assert service.round(Round({"a": sample(40, mismatches=1)})).status == "False"
    assert service.round(Round({"a": sample(40, mismatches=1)})).status == "True"


def test_an_old_drift_ages_out_while_a_growing_one_is_caught() -> None:
    service = Service()
    for _ in range(4):  # one abandoned request long ago: a constant offset is not a trend
        assert service.round(Round({"a": drifted(400, -397)})).status == "True"
    verdict = service.round(Round({"a": drifted(800, -437)}))
    assert (verdict.status, verdict.reason) == ("False", "EngineCounterDrift")
    for _ in range(11):
        verdict = service.round(Round({"a": drifted(800, -437)}))
    assert verdict.status == "True"  # the move left the window


def test_a_restarted_runtime_starts_its_drift_afresh() -> None:
    service = Service()
    service.round(Round({"a": drifted(10, -300.0, epoch=1.0)}))
    assert service.round(Round({"a": drifted(10, 0.0, epoch=2.0)})).status == "True"


def test_per_tenant_increases_follow_each_pod() -> None:
    service = Service()
    service.round(Round({"a": with_tenants(10, alpha=10), "b": with_tenants(5, beta=5)}))
    assert {t: c.completion_tokens for t, c in service.tenant_increase.items()} == {"alpha": 10, "beta": 5}
    service.round(Round({"a": with_tenants(18, alpha=12, beta=6), "b": with_tenants(5, beta=5)}))
    assert {t: c.completion_tokens for t, c in service.tenant_increase.items()} == {"alpha": 2, "beta": 6}


def test_observations_of_a_ledger_someone_else_moved_on_start_afresh() -> None:
    """A peer wrote while this operator paused: the tenants are booked from the ledger the peer wrote (never
    the peer's period again), and the window restarts."""
    mine = Service()
    mine.round(Round({"a": with_tenants(10, alpha=10)}))
    peer = Service()
    peer.ledger, peer.observations = mine.ledger, mine.observations
    peer.round(Round({"a": with_tenants(250, alpha=250)}))  # the peer served and booked 240 more
    mine.ledger = peer.ledger  # this operator resumes: it reads the ledger the peer wrote
    mine.round(Round({"a": with_tenants(260, alpha=260)}))
    assert mine.ledger.totals.completion_tokens == 260
    assert mine.tenant_increase["alpha"].completion_tokens == 10  # since the peer's reading, not 250 again
    assert mine.ledger.tenants["alpha"].completion_tokens == 260
    stale = Observations(sequence=1, good_streak=5)
    persisted = Verdict("UsageHealthy", "False", "UsageMismatch", "m")
    assert following(stale, Ledger(sequence=7), persisted) == Observations(sequence=7, unhealthy=persisted)
