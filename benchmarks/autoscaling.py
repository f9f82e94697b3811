"""Autoscaling: Tally's decision (operator/tally_operator/autoscale.py) against a plain HPA-style rule on the
same signal (replicas = ceil(queued / target), evaluated as often, same bounds), run the same way on one
simulated service.

The service: requests arrive at a rate that follows a load trace; each ready pod serves `--service-rate`
requests a second; a new pod is ready `--startup` seconds after it is asked for (a GPU model load); a removed
pod goes at once. The signal is the queue (requests waiting), read every `--interval` seconds, as the
operator scrapes it. Two traces: a step (a quiet base, then a sustained load at t=60 s) and bursts (a quiet
base with a short burst every 30 s). Reported per policy: for the step, the seconds to the first new pod
ready and to the queue drained; for the bursts, the scale events, the pod-seconds used and the worst queue.

    python benchmarks/autoscaling.py [--startup 120] [--service-rate 2] [--target 4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "runtime")]

from tally_operator.autoscale import Autoscaling, Observation, Recommendation, decide  # noqa: E402

DURATION = 1800


@dataclass
class Service:
    """A service at one moment: pods asked for (with when each will be ready) and the queue."""

    ready_at: list[float] = field(default_factory=lambda: [0.0])
    queue: float = 0.0

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)

    def scale(self, replicas: int, now: float, startup: float) -> None:
        if replicas > len(self.ready_at):
            self.ready_at += [now + startup] * (replicas - len(self.ready_at))
        elif replicas < len(self.ready_at):
            self.ready_at = sorted(self.ready_at)[:replicas]  # the newest (not ready yet) go first


Policy = Callable[[float, float, int, int], int]  # (now, signal, current, ready) -> replicas


def tally_policy(config: Autoscaling) -> Policy:
    history: list[Observation] = []
    recommendations: list[Recommendation] = []

    def policy(now: float, signal: float, current: int, ready: int) -> int:
        history.append(Observation(now, signal))
        decision = decide(config, history, recommendations, current, ready, False, now, 0.0)
        if decision.recommendation:
            recommendations.append(decision.recommendation)
        return decision.replicas

    return policy


def plain_policy(config: Autoscaling) -> Policy:
    def policy(now: float, signal: float, current: int, ready: int) -> int:
        return max(config.min_replicas, min(config.max_replicas, math.ceil(signal / config.target)))

    return policy


def run(policy: Policy, load: Callable[[float], float], rate: float, startup: float, interval: float) -> dict[str, Any]:
    service = Service()
    events = 0
    pod_seconds = worst = 0.0
    first_new: float | None = None
    drained: float | None = None
    for tick in range(int(DURATION / interval)):
        now = tick * interval
        ready = service.ready(now)
        service.queue = max(0.0, service.queue + (load(now) - ready * rate) * interval)
        worst = max(worst, service.queue)
        pod_seconds += len(service.ready_at) * interval
        if first_new is None and ready > 1:
            first_new = now
        if drained is None and first_new is not None and service.queue < 1:
            drained = now
        wanted = policy(now, service.queue, len(service.ready_at), ready)
        if wanted != len(service.ready_at):
            events += 1
            service.scale(wanted, now, startup)
    return {"scale_events": events, "pod_seconds": pod_seconds, "worst_queue": round(worst, 1),
            "first_new_pod_ready_s": first_new, "queue_drained_s": drained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--startup", type=float, default=120.0, help="seconds from asking for a pod to it serving")
    parser.add_argument("--service-rate", type=float, default=2.0, help="requests a second one ready pod serves")
    parser.add_argument("--target", type=float, default=4.0, help="queued requests per pod")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes and decisions")
    parser.add_argument("--json")
    args = parser.parse_args()
    config = Autoscaling(min_replicas=1, max_replicas=16, metric="queuedRequests", target=args.target)
    step_at = 60.0
    traces = {
        "step": lambda t: 1.0 if t < step_at else 12.0,
        "bursts": lambda t: 30.0 if t % 30 < 3 else 1.0,
    }
    report: dict[str, Any] = {"startup_s": args.startup, "service_rate": args.service_rate, "target": args.target,
                              "interval_s": args.interval, "results": {}}
    for trace, load in traces.items():
        for name, make in (("tally", tally_policy), ("plain", plain_policy)):
            result = run(make(config), load, args.service_rate, args.startup, args.interval)
            if trace == "step":
                for key in ("first_new_pod_ready_s", "queue_drained_s"):
                    if result[key] is not None:
                        result[key] -= step_at
            report["results"][f"{trace} {name}"] = result
            print(f"{trace:>6} {name:>5}: {result}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
