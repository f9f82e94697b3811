"""The tenant ledger (usage.py): tenants booked from the same persisted readings as the totals, their sums
equal to the totals field by field through every step, a sticky bound, and a status that stays small enough
for the API server at 1,000 tenants x 100 pods."""

from __future__ import annotations

import json
import random

import pytest
from tenant_pods import Pod

from tally_operator.samples import MAX_TENANTS_PER_POD, Counters, PodSample
from tally_operator.usage import (
    MAX_LEDGER_TENANTS,
    Ledger,
    Reading,
    Round,
    book,
    check_sums,
    ledger_from_status,
    ledger_status,
)


def persisted(ledger: Ledger) -> Ledger:
    """What the next pass reads: the ledger through its status form and JSON."""
    return ledger_from_status(json.loads(json.dumps(ledger_status(ledger))))


def test_tenant_totals_equal_what_each_tenant_was_served_through_restarts_drains_and_failed_scrapes() -> None:
    """A seeded random service: pods serve tenants, some scrapes fail, pods drain (final) and leave, others
    are replaced; every round goes through the status. Nothing is lost, so every tenant's ledger total is
    exactly what it was served, and the sums equal the totals after every round."""
    rng = random.Random(37)
    tenants = [f"team-{i}" for i in range(7)]
    served: dict[str, Counters] = {}
    pods = {f"pod-{i}": Pod(epoch=1.0) for i in range(3)}
    draining: set[str] = set()
    ledger, next_pod = Ledger(), 3
    for step in range(300):
        for uid, pod in pods.items():
            if uid not in draining and rng.random() < 0.7:
                tenant = rng.choice(tenants)
                more = pod.serve(tenant, rng.randint(1, 50), rng.randint(0, 90), rng.randint(0, 1))
                served[tenant] = served.get(tenant, Counters()).plus(more)
        if step % 17 == 5:  # one pod drains: its final counters are read, then it leaves
            draining.add(rng.choice(sorted(set(pods) - draining)))
        samples = {uid: pod.sample(final=uid in draining) for uid, pod in pods.items()
                   if uid in draining or rng.random() < 0.8}
        failed = frozenset(pods) - set(samples)
        ledger = persisted(book(ledger, Round(samples, failed, present=frozenset(pods))).ledger)
        check_sums(ledger)
        for uid in [u for u in draining if u in samples]:  # read final: gone at the next round
            del pods[uid]
            draining.discard(uid)
            pods[f"pod-{next_pod}"] = Pod(epoch=float(next_pod))
            next_pod += 1
    samples = {uid: pod.sample() for uid, pod in pods.items()}
    ledger = persisted(book(ledger, Round(samples, present=frozenset(pods))).ledger)
    assert ledger.unaccounted == 0
    assert ledger.tenants == served
    check_sums(ledger)


def test_a_lost_tail_is_lost_for_the_totals_and_the_tenants_alike() -> None:
    pod = Pod(epoch=1.0)
    pod.serve("a", 10, 20)
    ledger = book(Ledger(), Round({"p": pod.sample()})).ledger
    pod.serve("b", 5, 5)  # never read: the pod restarts its counters (a new epoch)
    restarted = Pod(epoch=2.0)
    restarted.serve("b", 1, 1)
    booking = book(persisted(ledger), Round({"p": restarted.sample()}))
    assert booking.lost == 1
    assert booking.ledger.tenants == {"a": Counters(1, 10, 20), "b": Counters(1, 1, 1)}
    check_sums(booking.ledger)


@pytest.mark.parametrize("change", ["pod-counter", "tenant-counter", "tenant-vanished"])
def test_a_reading_that_went_down_books_nothing_at_all(change: str) -> None:
    """Under one epoch a lower reading (a runtime back from a lagging journal) books nothing, in any field of
    the totals or any tenant, and becomes the new base: the sums still hold."""
    pod = Pod(epoch=1.0)
    pod.serve("a", 10, 20)
    pod.serve("b", 10, 20)
    ledger = persisted(book(Ledger(), Round({"p": pod.sample()})).ledger)
    lower = pod.sample()
    tenants = dict(lower.tenants)
    if change == "pod-counter" or change == "tenant-counter":
        tenants["a"] = Counters(1, 10, 19)
    else:
        del tenants["b"]
    tenants["c"] = Counters(1, 100, 100)  # and something new that would otherwise book
    totals = Counters()
    for counters in tenants.values():
        totals = totals.plus(counters)
    booking = book(ledger, Round({"p": PodSample(totals, "incremental", None, 1.0, False, tenants)}))
    assert booking.regressed == ("p",) and booking.lost == 1
    assert booking.ledger.totals == ledger.totals and booking.ledger.tenants == ledger.tenants
    pod.tenants = tenants
    pod.serve("c", 1, 1)
    after = book(persisted(booking.ledger), Round({"p": pod.sample()})).ledger
    assert after.tenants["c"] == Counters(1, 1, 1)  # booked from the new base
    check_sums(after)


def test_the_ledger_bound_is_sticky_and_counts_what_it_folds() -> None:
    """At MAX_LEDGER_TENANTS named tenants a new one goes to `other` for good; a tenant in the ledger keeps its
    own line however names come and go; `tenantsFolded` counts the names folded, once per pod and epoch."""
    full = {f"t{i:04d}": Counters(1, 1, 1) for i in range(MAX_LEDGER_TENANTS)}
    totals = Counters(MAX_LEDGER_TENANTS, MAX_LEDGER_TENANTS, MAX_LEDGER_TENANTS)
    ledger = Ledger(totals=totals, tenants=full)
    pod = Pod(epoch=1.0)
    pod.serve("aaa-new", 5, 5)  # sorts first by name: a name-ordered fold would keep it and drop a kept one
    pod.serve("t0999", 2, 2)
    booking = book(ledger, Round({"p": pod.sample()}))
    assert "aaa-new" not in booking.ledger.tenants and booking.ledger.tenants["other"] == Counters(1, 5, 5)
    assert booking.ledger.tenants["t0999"] == Counters(2, 3, 3) and booking.folded == 1
    pod.serve("aaa-new", 1, 1)
    again = book(persisted(booking.ledger), Round({"p": pod.sample()}))
    assert again.ledger.tenants["other"] == Counters(2, 6, 6) and again.folded == 0
    assert again.ledger.tenants_folded == 1
    check_sums(again.ledger)


def test_a_status_from_before_the_tenant_ledger_keeps_its_sums() -> None:
    """An upgrade: the totals so far are in tenant `other`; readings without tenant counters are their
    tenants' baseline, and what those do not explain is booked to `other`."""
    old = {"requests": 3, "promptTokens": 30, "completionTokens": 60, "cachedTokens": 0, "sequence": 4,
           "pods": [{"uid": "p", "epoch": 1.0, "requests": 3, "promptTokens": 30, "completionTokens": 60}]}
    ledger = ledger_from_status(old)
    assert ledger.tenants == {"other": Counters(3, 30, 60)}
    pod = Pod(epoch=1.0)
    pod.tenants = {"a": Counters(3, 30, 60)}
    pod.serve("a", 1, 1)
    booked = book(ledger, Round({"p": pod.sample()})).ledger
    assert booked.tenants == {"other": Counters(4, 31, 61)}  # the first reading is a's baseline
    pod.serve("a", 1, 1)
    booked = book(persisted(booked), Round({"p": pod.sample()})).ledger
    assert booked.tenants == {"other": Counters(4, 31, 61), "a": Counters(1, 1, 1)}
    check_sums(booked)


def test_a_hostile_status_is_bounded_and_never_crashes_the_reader() -> None:
    status = {"tenants": {"a": {"requests": -1, "promptTokens": "x"}, "b": [], **{
        f"x{i}": {"requests": 1} for i in range(MAX_LEDGER_TENANTS + 50)}},
        "pods": [{"uid": "p", "tenants": {"a": [1, 2], "b": [1, 2, 3, 1e300], "c": "no"}}, {"uid": 5}]}
    ledger = ledger_from_status(status)
    assert len(ledger.tenants) <= MAX_LEDGER_TENANTS + 1 and ledger.tenants["a"] == Counters()
    assert ledger.readings["p"].tenants == {"b": Counters(1, 2, 3, 0)}


def test_the_status_at_1000_tenants_and_100_pods_fits_the_api_server() -> None:
    """Each pod reports at most its runtime's --max-tenants (100) and `other`; the service keeps 1,000 tenants
    and `other`. The whole `status.usage` must stay well under etcd's 1.5 MiB request limit."""
    ledger_tenants = {f"tenant-{i:04d}": Counters(123_456, 12_345_678_901, 9_876_543_210, 1_234_567_890)
                      for i in range(MAX_LEDGER_TENANTS)}
    pods = {f"{i:08d}-0000-4000-8000-000000000000": PodSample(
        Counters(), "incremental", None, 1_733_000_000.123, False,
        {f"tenant-{(i * 10 + j) % 1000:04d}": Counters(12_345, 1_234_567_890, 987_654_321, 123_456_789)
         for j in range(100)} | {"other": Counters(1, 1, 1, 1)}) for i in range(100)}
    status = ledger_status(Ledger(tenants=ledger_tenants | {"other": Counters(1, 1, 1)}))
    status["pods"] = ledger_status(Ledger(readings={
        uid: Reading(Counters(), s.started, False, s.tenants) for uid, s in pods.items()}))["pods"]
    size = len(json.dumps(status, separators=(",", ":")))
    print(f"status.usage at 1,000 tenants x 100 pods: {size} bytes")
    assert size < 1_000_000, size
    assert MAX_TENANTS_PER_POD >= 101
