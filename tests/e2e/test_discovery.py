"""The operator's API client across threads, against the real API server: passes look kinds up from kopf's
thread pool while a routed service asks whether the InferencePool kind is served, and a kind not served
makes the client rebuild its discovery cache in place. Lookups from other threads meanwhile must still find
every kind (a pass once failed with no Pod kind at all)."""

from __future__ import annotations

import threading
import time

import pytest

from tally_operator.kube import Kube

pytestmark = pytest.mark.e2e

THREADS = 6
SECONDS = 8.0  # bounded: the lookups stop then


def test_lookups_from_other_threads_survive_a_discovery_rebuild(kube_env: dict[str, str]) -> None:
    kube = Kube(kube_env["KUBECONFIG"])
    failures: list[str] = []
    lookups = [0]
    lock = threading.Lock()
    stop = time.monotonic() + SECONDS

    def list_pods() -> None:
        while time.monotonic() < stop:
            try:
                kube.pods("kube-system", "app=none")
            except Exception as err:  # what a pass would have died of
                with lock:
                    failures.append(f"{type(err).__name__}: {err}")
            with lock:
                lookups[0] += 1

    def ask_for_missing_kinds() -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1  # a new kind each time: each miss rebuilds the cache (a kind asked again waits 30 s)
            assert not kube.has("example.invalid/v1", f"Missing{i}")

    threads = [threading.Thread(target=list_pods) for _ in range(THREADS)]
    threads.append(threading.Thread(target=ask_for_missing_kinds))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SECONDS + 60)
    assert lookups[0] > THREADS  # the interleaving happened
    assert not failures, failures[:3]
    assert not kube.has("example.invalid/v1", "Missing1")  # remembered as missing, not looked up again
    assert kube.has("v1", "Pod")
