"""PURE: a service's usage-health verdict, over a window of recent rounds and with hysteresis.

It turns unhealthy at once, and healthy again only after several clean rounds in a row; a round with
nothing scraped is no evidence either way.
"""

from __future__ import annotations

from dataclasses import replace

from tally_operator import constants as c
from tally_operator.conditions import Verdict
from tally_operator.observations import Observations
from tally_operator.samples import Counters
from tally_operator.usage import Round

HEALTHY_STREAK = 2


def judge(observations: Observations, round_: Round, max_mismatch_ratio: float) -> tuple[Verdict, Observations]:
    """UsageHealthy for this round, with hysteresis (bad at once, good after a clean streak); returns the
    verdict and the observations with the streak moved on."""
    raw = _raw_verdict(observations, round_, max_mismatch_ratio)
    if raw.status == "True":
        streak = observations.good_streak + 1
        if observations.unhealthy is not None and streak < HEALTHY_STREAK:
            return observations.unhealthy, replace(observations, good_streak=streak)
        return raw, replace(observations, good_streak=streak, unhealthy=None)
    # Unknown (nothing scraped) is no evidence either way: it neither clears nor counts as clean.
    unhealthy = raw if raw.status == "False" else observations.unhealthy
    return raw, replace(observations, good_streak=0, unhealthy=unhealthy)


def _raw_verdict(observations: Observations, round_: Round, max_mismatch_ratio: float) -> Verdict:
    if not round_.samples:
        return Verdict(c.USAGE_HEALTHY, "Unknown", "NoPodsScraped",
                       f"No pod could be scraped ({len(round_.failed)} failed)")
    cumulative = [uid for uid, s in round_.samples.items() if s.stream_mode != "incremental"]
    if cumulative:
        return Verdict(c.USAGE_HEALTHY, "False", "CumulativeStreaming",
                       f"{len(cumulative)} pod(s) report stream mode other than incremental")
    window = Counters()
    for delta in observations.window:
        window = window.plus(delta)
    if window.derived_requests > 0:
        return Verdict(c.USAGE_HEALTHY, "False", "EngineUsageMissing",
                       f"The engine reported no usage for {int(window.derived_requests)} recent request(s)")
    if window.mismatches > 0 and window.mismatches > max_mismatch_ratio * max(window.requests, 1):
        return Verdict(c.USAGE_HEALTHY, "False", "UsageMismatch",
                       f"{int(window.mismatches)} recent choice(s) streamed a different number of tokens than "
                       f"the engine counted ({int(window.requests)} requests)")
    # Drift is read when a pod had nothing in flight; what matters is how it moved within the window
    # (an old disagreement, say one abort long ago, ages out instead of marking the pod for ever).
    moved = [abs(values[-1] - values[0]) for uid, values in observations.drifts.items()
             if uid in round_.samples and values]
    if moved and max(moved) > max(16.0, 0.01 * window.completion_tokens):
        return Verdict(c.USAGE_HEALTHY, "False", "EngineCounterDrift",
                       f"Completion tokens moved {int(max(moved))} away from SGLang's own counter in the last "
                       f"{len(observations.window)} round(s)")
    return Verdict(c.USAGE_HEALTHY, "True", "UsageConsistent",
                   f"Engine usage matches the streamed tokens on {len(round_.samples)} pod(s)")
