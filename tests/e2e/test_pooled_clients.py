"""Pooled clients through a rollout and a scale-down, on the real node: the `openai` SDK with its default
connection pooling and retries keeps a steady load on a two-pod service's ClusterIP while its pods are
replaced and then one is removed, and sees no failed request; status.usage equals what it received.

A Service balances per connection, so a pooled client keeps sending to the pod its connection reached. The
review saw every request during a drain get 503 on one connection, and an SDK call fail after three tries
with no new connection; a draining pod now closes idle connections and says `Connection: close`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest
from kube_harness import Kubectl, eventually, in_cluster
from operator_harness import ChartOperator
from usage_harness import MODEL, live_pods, service, serving_pods, status, totals_match

pytestmark = pytest.mark.e2e

CLIENTS = 2
LOAD_SECONDS = 420  # a bound: the load stops earlier, once the rollout and the scale-down are done


class PooledLoad:
    """`CLIENTS` SDK clients, each with its own pooled connections, calling back to back until stopped."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.received: list[dict[str, int]] = []
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def client(self, i: int) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        with in_cluster(120) as http:
            sdk = openai.OpenAI(base_url=self.base_url, api_key="unused", http_client=http)  # default retries
            calls = 0
            while not self.stop.is_set() and time.monotonic() < deadline:
                calls += 1
                try:
                    usage = self.call(sdk, f"Story {i}.{calls}:", stream=calls % 2 == 0)
                except openai.APIError as err:
                    with self.lock:
                        self.failures.append(f"{type(err).__name__}: {err}")
                    continue
                with self.lock:
                    self.received.append(usage)

    @staticmethod
    def call(sdk: openai.OpenAI, prompt: str, stream: bool) -> dict[str, int]:
        if stream:
            chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True}))
            usage: Any = chunks[-1].usage
        else:
            usage = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           extra_body={"ignore_eos": True}).usage
        assert usage is not None
        return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens}

    def __enter__(self) -> PooledLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)

    def served(self) -> int:
        with self.lock:
            return len(self.received)


def test_pooled_sdk_clients_see_no_failure_through_a_rollout_and_a_scale_down(
        operator: ChartOperator, kube: Kubectl) -> None:
    manifest = service(replicas=2)
    manifest["spec"]["drainSeconds"] = 60
    kube.apply(manifest)
    before = {p["metadata"]["uid"] for p in serving_pods(kube, 2)}
    ip = kube.json("get", "service", "smollm")["spec"]["clusterIP"]
    with PooledLoad(f"http://{ip}:8000/v1") as load:
        eventually(lambda: load.served() >= 10, 120, interval=0.5, what="a steady load")
        manifest["spec"]["engine"]["env"] = [{"name": "ROLLOUT", "value": "1"}]  # a new pod template: a rollout
        kube.apply(manifest)

        def rolled_out() -> bool:
            pods = live_pods(kube)
            return len(pods) == 2 and not before & {p["metadata"]["uid"] for p in pods} and \
                len(serving_pods(kube, 2)) == 2

        eventually(rolled_out, 300, interval=1, what="both pods replaced")
        at_rollout = load.served()
        kube("scale", "completionservice", "smollm", "--replicas=1")
        eventually(lambda: len(live_pods(kube)) == 1, 180, interval=1, what="one pod after the scale-down")
        eventually(lambda: load.served() >= at_rollout + 10, 120, interval=0.5, what="the load after it")
    assert not load.failures, load.failures[:3]
    sent = load.received
    eventually(lambda: totals_match(kube, sent), 120, interval=1, what="status.usage equal to what clients received")
    assert (status(kube).get("usage") or {}).get("podsUnaccounted") == 0
