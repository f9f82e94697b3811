"""I/O: what a scaled-to-zero service's activator holds, read from its own pods' `/held` (on their metrics
port). Only pods of the activator Deployment this CompletionService controls are asked (a pod that merely
carries the label is not ours), and each answer is bounded and checked: a hostile or broken answer counts as
nothing held, never as a crash. `?wait=N` makes the read a long-poll that returns as soon as anything is
held: how a held request reaches the operator at once rather than at the next scrape."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tally_operator import constants as c
from tally_operator.kube import Kube
from tally_operator.scrape import scrape
from tally_operator.usage import controller_uid, owned_pods, pod_url

MAX_HELD_BYTES = 4096  # {"held": n, "lastColdStartSeconds": x}
MAX_HELD = 1_000_000  # more than any activator holds: a larger count is refused as not an activator's


@dataclass(frozen=True, slots=True)
class Held:
    requests: int = 0  # summed over the activator pods read
    cold_start_seconds: float | None = None  # the largest of their last held-to-first-byte times
    pods_read: int = 0

    def status(self, idle_seconds: float) -> dict[str, object]:
        out: dict[str, object] = {"heldRequests": self.requests, "idleSeconds": round(max(0.0, idle_seconds), 1)}
        if self.cold_start_seconds is not None:
            out["coldStartSeconds"] = round(self.cold_start_seconds, 3)
        return out


def activator_pods(kube: Kube, meta: Mapping[str, str]) -> list[Mapping[str, Any]]:
    """The activator's pods with an address: controlled by a ReplicaSet of the activator Deployment that
    this CompletionService controls."""
    name, namespace = meta["name"], meta["namespace"]
    deployment = kube.get("apps/v1", "Deployment", name + c.ACTIVATOR_SUFFIX, namespace)
    if deployment is None or controller_uid(deployment) != meta["uid"]:
        return []
    selector = f"{c.LABEL_ACTIVATOR}={name}"
    pods = owned_pods(kube.pods(namespace, selector), kube.list("apps/v1", "ReplicaSet", namespace, selector),
                      deployment, meta["uid"])
    return [p for p in pods if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")]


def parse_held(text: str) -> tuple[int, float | None]:
    """One pod's answer; ValueError if it is not what an activator says."""
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    held, cold = body.get("held"), body.get("lastColdStartSeconds")
    if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held <= MAX_HELD:
        raise ValueError(f"held must be an integer from 0 to {MAX_HELD}")
    if cold is not None and (not isinstance(cold, int | float) or isinstance(cold, bool) or not math.isfinite(cold)
                             or not 0 <= cold <= 86400):
        raise ValueError("lastColdStartSeconds must be a number of seconds")
    return held, None if cold is None else float(cold)


async def read_held(kube: Kube, meta: Mapping[str, str], concurrency: int, per_pod_seconds: float,
                    wait: float = 0.0) -> Held:
    """What the activator pods hold now; with `wait`, as soon as any holds something (at most `wait` s)."""
    pods = await asyncio.to_thread(activator_pods, kube, meta)
    if not pods:
        return Held()
    urls = {p["metadata"]["uid"]: pod_url(p["status"]["podIP"], c.RUNTIME_METRICS_PORT, f"/held?wait={wait:g}")
            for p in pods}
    if wait:
        return await _first_held(urls, concurrency, per_pod_seconds + wait)
    return _summed(await scrape(urls, concurrency, per_pod_seconds, max_bytes=MAX_HELD_BYTES))


async def _first_held(urls: Mapping[str, str], concurrency: int, per_pod_seconds: float) -> Held:
    """Long-poll every pod; return once one answers with something held, or all have answered."""
    tasks = [asyncio.create_task(scrape({uid: url}, concurrency, per_pod_seconds, max_bytes=MAX_HELD_BYTES))
             for uid, url in urls.items()]
    results: dict[str, str | Exception] = {}
    try:
        for done in asyncio.as_completed(tasks):
            results |= await done
            held = _summed(results)
            if held.requests:
                return held
        return _summed(results)
    finally:
        for task in tasks:
            task.cancel()


def _summed(results: Mapping[str, str | Exception]) -> Held:
    requests, colds, read = 0, [], 0
    for result in results.values():
        if isinstance(result, Exception):
            continue
        try:
            held, cold = parse_held(result)
        except ValueError:  # json.JSONDecodeError is one
            continue
        requests, read = requests + held, read + 1
        if cold is not None:
            colds.append(cold)
    return Held(requests, max(colds) if colds else None, read)
