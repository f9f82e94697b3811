"""PURE: what the operator remembers of one service between rounds, in memory only.

The ledger itself is persisted (usage.py), tenants included; these are only the recent history the health
verdict looks at (the window of increases, each pod's drift readings, the hysteresis). They follow one
ledger: `sequence` is the ledger sequence they were last advanced with. A ledger written in the meantime by
someone else (a peer that took over while this operator paused, a predecessor) makes them stale, and they
start afresh from that ledger.

`advance` returns new observations and never changes its input, so a round can be booked again on a
fresher ledger when a status write was refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tally_operator.conditions import Verdict
from tally_operator.samples import Counters
from tally_operator.usage import Booking, Ledger, Round

WINDOW_ROUNDS = 10


@dataclass(frozen=True, slots=True)
class Observations:
    sequence: int | None = None  # the ledger sequence these follow (None: nothing yet)
    window: tuple[Counters, ...] = ()  # the last rounds' increases, oldest first
    drifts: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # pod uid -> recent drift readings
    good_streak: int = 0
    unhealthy: Verdict | None = None  # the last definite verdict, when False: True needs a clean streak


def following(observations: Observations, ledger: Ledger, persisted: Verdict | None) -> Observations:
    """The observations if they follow `ledger`; otherwise fresh ones, which keep only a persisted
    UsageHealthy=False (so a stale memory cannot clear it without a clean streak)."""
    if observations.sequence == ledger.sequence:
        return observations
    unhealthy = persisted if persisted is not None and persisted.status == "False" else None
    return Observations(sequence=ledger.sequence, unhealthy=unhealthy)


def advance(observations: Observations, before: Ledger, booking: Booking, round_: Round) -> Observations:
    """The observations after a round."""
    drifts = {uid: values for uid, values in observations.drifts.items() if uid in booking.ledger.readings}
    for uid, sample in sorted(round_.samples.items()):
        reading = before.readings.get(uid)
        if reading is not None and reading.epoch != sample.started:
            drifts.pop(uid, None)
        if sample.completion_drift is not None:
            drifts[uid] = (*drifts.get(uid, ()), sample.completion_drift)[-WINDOW_ROUNDS:]
    window = (*observations.window, booking.increase)[-WINDOW_ROUNDS:]
    return replace(observations, sequence=booking.ledger.sequence, window=window, drifts=drifts)
