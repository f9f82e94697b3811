"""Pooled clients through a rollout and a scale-down, on the real node: the `openai` SDK with its default
connection pooling and retries keeps a steady load on a two-pod service's ClusterIP while its pods are
replaced and then one is removed, and sees no failed request; status.usage equals what it received.

A Service balances per connection, so a pooled client keeps sending to the pod its connection reached. The
review saw every request during a drain get 503 on one connection, and an SDK call fail after three tries
with no new connection; a draining pod now closes idle connections and says `Connection: close`.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from kube_harness import Kubectl, eventually, in_cluster, reachable_cluster_ip
from operator_harness import ChartOperator
from usage_harness import MODEL, ClientThreads, live_pods, service, serving_pods, status, totals_match

pytestmark = pytest.mark.e2e

CLIENTS = 2
LOAD_SECONDS = 420  # a bound: the load stops earlier, once the rollout and the scale-down are done


class PooledLoad(ClientThreads):
    """`CLIENTS` SDK clients, each with its own pooled connections, calling back to back until stopped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(CLIENTS)
        self.base_url = base_url

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
                    causes, cause = [], err.__cause__ or err.__context__
                    while cause is not None and len(causes) < 4:
                        causes.append(f"{type(cause).__name__}: {cause}")
                        cause = cause.__cause__ or cause.__context__
                    with self.lock:
                        self.failures.append(f"{time.strftime('%H:%M:%S')} {type(err).__name__}: {err} <- "
                                             + " <- ".join(causes))
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


def ready_endpoints(kube: Kubectl) -> int:
    slices = kube.json("get", "endpointslices", "-l", "kubernetes.io/service-name=smollm")["items"]
    return sum(1 for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready"))


def test_pooled_sdk_clients_see_no_failure_through_a_rollout_and_a_scale_down(
        operator: ChartOperator, kube: Kubectl) -> None:
    manifest = service(replicas=2)
    manifest["spec"]["drainSeconds"] = 60
    kube.apply(manifest)
    before = {p["metadata"]["uid"] for p in serving_pods(kube, 2)}
    # The Service's endpoints follow the kubelet's readiness, a little after the pods answer /health: until
    # then kube-proxy rejects connections to the ClusterIP (host unreachable)
    eventually(lambda: ready_endpoints(kube) == 2, 60, interval=0.5, what="two ready endpoints")
    ip = reachable_cluster_ip(kube, "smollm", 8000)
    with PooledLoad(f"http://{ip}:8000/v1") as load:
        eventually(lambda: load.served() >= 10, 120, interval=0.5, what="a steady load")
        manifest["spec"]["engine"]["env"] = [{"name": "TZ", "value": "UTC"}]  # a new pod template: a rollout
        kube.apply(manifest)

        def rolled_out() -> bool:
            pods = live_pods(kube)
            return len(pods) == 2 and not before & {p["metadata"]["uid"] for p in pods} and \
                len(serving_pods(kube, 2)) == 2

        print(f"\n[pooled] {time.strftime('%H:%M:%S')} rollout asked")
        eventually(rolled_out, 300, interval=1, what="both pods replaced")
        print(f"[pooled] {time.strftime('%H:%M:%S')} rolled out")
        at_rollout = load.served()
        kube("scale", "completionservice", "smollm", "--replicas=1")
        eventually(lambda: len(live_pods(kube)) == 1, 180, interval=1, what="one pod after the scale-down")
        print(f"[pooled] {time.strftime('%H:%M:%S')} scaled down")
        eventually(lambda: load.served() >= at_rollout + 10, 120, interval=0.5, what="the load after it")
    if load.failures:  # when they happened, against what the cluster did
        events = kube("get", "events", "--sort-by=.lastTimestamp", "-o",
                      "custom-columns=T:.lastTimestamp,R:.reason,O:.involvedObject.name,M:.message")
        raise AssertionError(f"{len(load.failures)} failed: {load.failures[:3]}\n{events}")
    sent = load.received
    eventually(lambda: totals_match(kube, sent), 120, interval=1, what="status.usage equal to what clients received")
    assert (status(kube).get("usage") or {}).get("podsUnaccounted") == 0
