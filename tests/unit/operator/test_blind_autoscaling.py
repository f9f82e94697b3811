"""Autoscaling rounds as the operator runs them (`scaling.autoscale`): pods that stop answering /metrics
are not idle pods, a peer that resumes continues from the Deployment, and the memory a pass keeps."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator import scaling as scaling_pass
from tally_operator.autoscale import Autoscaling
from tally_operator.context import Scaling, Scraped
from tally_operator.samples import Counters, PodSample
from tally_operator.scaling import autoscale
from tally_operator.usage import Round
from tally_runtime import contract

CONFIG = Autoscaling(min_replicas=1, max_replicas=8, metric="queuedRequests", target=4.0,
                     stable_window_seconds=30, panic_window_seconds=6, scale_down_delay_seconds=60)


def pod(uid: str) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "name": uid},
            "status": {"podIP": "198.18.0.9", "conditions": [{"type": "Ready", "status": "True"}]}}


def sample(queued: float) -> PodSample:
    return PodSample(Counters(requests=1), "incremental", None, 1.0, load={contract.QUEUED_REQUESTS: queued})


def rounds(monkeypatch: pytest.MonkeyPatch, pods: int, answering: int, seconds: int) -> list[int]:
    """Replicas after each 2 s round: every pod queues 4 until second 10, then only `answering` answer."""
    clock = [1000.0]
    monkeypatch.setattr(scaling_pass.time, "monotonic", lambda: clock[0])
    scaling, current, seen = Scaling(since=clock[0] - 3600), pods, []
    all_pods = [pod(f"p{i}") for i in range(pods)]
    for second in range(0, seconds, 2):
        clock[0] = 1000.0 + second
        live = all_pods if second < 10 else all_pods[:answering]
        samples = {p["metadata"]["uid"]: sample(4.0) for p in live}
        failed = frozenset(p["metadata"]["uid"] for p in all_pods[:current]) - set(samples)
        scraped = autoscale(CONFIG, current, all_pods[:current],
                            Scraped(Round(samples, failed), {}, {}), scaling)
        assert scraped.decision is not None and scraped.scaling is not None
        scaling, current = scraped.scaling, scraped.decision.replicas
        seen.append(current)
    return seen


@pytest.mark.parametrize("answering", [0, 1])
def test_pods_that_stop_answering_are_not_read_as_idle(monkeypatch: pytest.MonkeyPatch, answering: int) -> None:
    """The review's scenario: 4 pods with 4 queued requests each stop answering /metrics. Read as zero load
    the service went 4 -> 3 -> 1 within 30 s (all blind) or 4 -> 1 (3 of 4 blind)."""
    assert min(rounds(monkeypatch, pods=4, answering=answering, seconds=120)) == 4


def test_an_unread_pods_memory_is_not_kept_when_it_went_blind_for_a_whole_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [5000.0]
    monkeypatch.setattr(scaling_pass.time, "monotonic", lambda: clock[0])
    from tally_operator.autoscale import Observation

    stale = Scaling(since=0.0, history=(Observation(5000.0 - 3600, 0.0),))
    scraped = autoscale(CONFIG, 4, [pod(f"p{i}") for i in range(4)],
                        Scraped(Round({f"p{i}": sample(0.0) for i in range(4)}), {}, {}), stale)
    assert scraped.scaling is not None and scraped.scaling.since == clock[0]  # watched afresh: no scale-down yet
    assert scraped.decision is not None and scraped.decision.replicas == 4


class Deployments:
    """The one API call `decided_replicas` makes: the Deployment as the API server has it now."""

    def __init__(self, replicas: int, owner: str = "uid-1") -> None:
        self.deployment = {"metadata": {"ownerReferences": [{"uid": owner, "controller": True}]},
                           "spec": {"replicas": replicas}}

    def get(self, *_: object) -> dict[str, Any]:
        return self.deployment


def test_a_peer_that_resumes_continues_from_the_deployment_not_from_its_memory() -> None:
    """The review: a peer paused while the other scaled to 6 applied its old 2 on resuming (and panicked back
    to 4); autoscaling switched off and on an hour later applied 6 then 1 in one pass."""
    import asyncio
    from types import SimpleNamespace

    from tally_operator.scaling import decided_replicas

    meta = {"name": "s", "namespace": "n", "uid": "uid-1"}
    wide = Autoscaling(min_replicas=1, max_replicas=8, metric="queuedRequests", target=4.0)

    def decided(kube: Deployments) -> int:
        return asyncio.run(decided_replicas(SimpleNamespace(kube=kube), meta, wide))  # type: ignore[arg-type]

    assert decided(Deployments(6)) == 6
    assert decided(Deployments(12)) == 8  # bounds apply at once
    assert decided(Deployments(6, owner="someone-else")) == 1  # a namesake's count is not ours


def test_a_foreign_namesake_deployment_is_a_conflict_on_every_pass_not_our_readiness() -> None:
    """Refresh passes (which do not apply) used to report a same-named Deployment of someone else's as the
    service's own readiness for up to a minute."""
    from types import SimpleNamespace

    from tally_operator.children import read_children
    from tally_operator.spec import SpecError

    kube = SimpleNamespace(get=Deployments(3, owner="someone-else").get, list=lambda *_: [], pods=lambda *_: [])
    with pytest.raises(SpecError) as conflict:
        read_children(SimpleNamespace(kube=kube), {"name": "s", "namespace": "n", "uid": "uid-1"})  # type: ignore[arg-type]
    assert conflict.value.reason == "NameConflict"
