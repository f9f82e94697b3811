"""The ledger: per-pod readings booked into totals across restarts, regressions, unready, gone and terminal
pods; persistence; which pods are counted and where they are reached."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator.samples import Counters, PodSample
from tally_operator.usage import (
    Ledger,
    Reading,
    Round,
    book,
    counted_uids,
    ledger_from_status,
    ledger_status,
    owned_pods,
    scrape_targets,
)


def at(completion: float, epoch: float = 1.0, final: bool = False) -> PodSample:
    return PodSample(Counters(requests=completion / 4, completion_tokens=completion), "incremental", None, epoch, final)


def run(*rounds: Round, ledger: Ledger | None = None) -> Ledger:
    ledger = ledger or Ledger()
    for round_ in rounds:
        ledger = book(ledger, round_).ledger
    return ledger


@pytest.mark.parametrize(("rounds", "completion", "unaccounted"), [
    pytest.param([{"a": at(100)}, {"a": at(140)}], 140, 0, id="increases-add-up"),
    pytest.param([{"a": at(100, epoch=1)}, {"a": at(12, epoch=2)}], 112, 1, id="new-epoch-is-all-new"),
    pytest.param([{"a": at(12, epoch=100)}, {"a": at(14, epoch=200)}], 26, 1,
                 id="restart-detected-by-epoch-even-when-counters-climbed-past"),
    pytest.param([{"a": at(800)}, {"a": at(500)}, {"a": at(560)}], 860, 1,
                 id="decrease-under-one-epoch-books-nothing-and-rebases"),
    pytest.param([{"a": at(40)}, {"a": at(40), "b": at(8)}], 48, 0, id="a-pod-without-a-reading-is-new"),
    pytest.param([{"a": at(10, final=True)}, {"a": at(10, epoch=2)}], 20, 0, id="new-epoch-after-a-final-read"),
])
def test_booking_rules(rounds: list[dict[str, PodSample]], completion: float, unaccounted: int) -> None:
    ledger = run(*(Round(samples) for samples in rounds))
    assert (ledger.totals.completion_tokens, ledger.unaccounted) == (completion, unaccounted)


def test_a_journal_that_lagged_is_never_counted_twice() -> None:
    """A runtime came back under the same epoch from a journal behind what was read (true total 800)."""
    ledger = run(Round({"a": at(800)}))
    booking = book(ledger, Round({"a": at(500)}))
    assert booking.increase == Counters() and booking.regressed == ("a",)
    ledger = run(Round({"a": at(700)}), ledger=booking.ledger)  # it served 200 more since
    assert ledger.totals.completion_tokens == 1000


def test_a_pod_unready_for_a_round_keeps_its_reading() -> None:
    ledger = run(Round({"a": at(1000)}, present=frozenset({"a"})), Round({}, present=frozenset({"a"})),
                 Round({"a": at(1200)}, present=frozenset({"a"})))
    assert ledger.totals.completion_tokens == 1200 and ledger.unaccounted == 0


def test_a_pod_gone_after_its_final_read_is_exact_and_one_gone_before_is_unaccounted() -> None:
    ledger = run(Round({"a": at(10), "b": at(10)}), Round({"a": at(30, final=True), "b": at(12)}),
                 Round({}, present=frozenset()))
    assert ledger.totals.completion_tokens == 42
    assert ledger.unaccounted == 1 and dict(ledger.readings) == {}


def test_pods_seen_first_after_an_upgrade_from_a_status_without_readings_are_a_baseline() -> None:
    old = ledger_from_status({"requests": 125, "completionTokens": 500})  # written before readings existed
    ledger = run(Round({"old": at(300)}), Round({"old": at(320), "new": at(8)}), ledger=old)
    assert ledger.totals.completion_tokens == 500 + 20 + 8


def test_booking_is_pure_and_moves_the_sequence() -> None:
    ledger = run(Round({"a": at(10)}))
    round_ = Round({"a": at(20)})
    first, again = book(ledger, round_), book(ledger, round_)
    assert first == again and ledger.totals.completion_tokens == 10
    assert first.ledger.sequence == ledger.sequence + 1


def test_a_restarted_operator_continues_exactly_from_the_status() -> None:
    before = run(Round({"a": at(100), "b": at(40)}))
    written = ledger_status(before)
    assert [p["uid"] for p in written["pods"]] == ["a", "b"]  # type: ignore[index]
    after = ledger_from_status(written)
    assert after == before
    after = run(Round({"a": at(116), "b": at(40), "c": at(8)}), ledger=after)  # served while no operator ran
    assert after.totals.completion_tokens == 140 + 16 + 8
    assert after.totals.requests == (100 + 40) / 4 + 4 + 2


def pod(uid: str, ready: bool = True, deleting: bool = False, phase: str = "Running", ip: str = "",
        owner: str = "rs-1") -> dict[str, Any]:
    meta: dict[str, Any] = {"uid": uid, "ownerReferences": [{"uid": owner, "controller": True}],
                            **({"deletionTimestamp": "2026-12-03T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip or f"198.18.1.{len(uid)}", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_terminating_and_known_unready_pods_are_scraped_new_unready_and_terminal_ones_are_not() -> None:
    pods = [pod("r"), pod("tt", deleting=True), pod("kkk", ready=False), pod("nnnn", ready=False),
            pod("fffff", ready=False, phase="Failed")]
    readings = {"kkk": Reading(Counters(), 1.0), "fffff": Reading(Counters(), 1.0)}
    targets = scrape_targets(pods, readings, 8000)
    assert sorted(targets) == ["kkk", "r", "tt"]
    assert targets["tt"] == "http://198.18.1.2:8000/metrics"
    assert "fffff" not in counted_uids(pods)  # an evicted pod is booked as gone, and its IP never read again


def test_an_evicted_pod_leaves_the_ledger_and_its_reused_ip_is_not_counted() -> None:
    ledger = run(Round({"e": at(500)}))
    pods = [pod("e", ready=False, phase="Failed")]
    ledger = run(Round({}, present=counted_uids(pods)), ledger=ledger)
    assert dict(ledger.readings) == {} and ledger.unaccounted == 1
    assert scrape_targets(pods, ledger.readings, 8000) == {}


def test_an_ipv6_pod_ip_is_bracketed() -> None:
    assert scrape_targets([pod("a", ip="fd00::5")], {}, 8000) == {"a": "http://[fd00::5]:8000/metrics"}


def test_only_pods_of_this_services_own_replica_sets_are_counted() -> None:
    deployment = {"metadata": {"uid": "dep", "ownerReferences": [{"uid": "cs", "controller": True}]}}
    replica_sets = [{"metadata": {"uid": "rs-1", "ownerReferences": [{"uid": "dep", "controller": True}]}},
                    {"metadata": {"uid": "rs-x", "ownerReferences": [{"uid": "old-dep", "controller": True}]}}]
    pods = [pod("mine"), pod("namesake", owner="rs-x"), pod("stray", owner="someone")]
    assert [p["metadata"]["uid"] for p in owned_pods(pods, replica_sets, deployment, "cs")] == ["mine"]
    assert owned_pods(pods, replica_sets, deployment, "another-cs") == []  # a Deployment we do not own
    assert owned_pods(pods, replica_sets, None, "cs") == []


def test_totals_stay_an_integer_the_status_can_hold() -> None:
    from tally_operator.samples import MAX_COUNT

    ledger = run(Round({"a": at(MAX_COUNT)}), Round({"a": at(MAX_COUNT), "b": at(MAX_COUNT)}))
    assert ledger.totals.completion_tokens == MAX_COUNT < 2**63


def test_after_an_upgrade_a_pod_whose_first_scrape_failed_is_a_baseline_when_read() -> None:
    """Its counters were in the old totals already: read later, it is not new usage."""
    old = ledger_from_status({"requests": 125, "completionTokens": 500})
    ledger = run(Round({"a": at(300)}, failed=frozenset({"b"})), Round({"a": at(310), "b": at(200)}),
                 Round({"a": at(310), "b": at(205)}), ledger=old)
    assert ledger.totals.completion_tokens == 500 + 10 + 5
