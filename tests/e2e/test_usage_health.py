"""Usage health end to end: runtimes as pods on the real node, scraped by the chart's operator pods."""

from __future__ import annotations

from typing import Any

import pytest
from kube_harness import Kubectl, container_id, eventually, node_ctr
from operator_harness import ChartOperator
from runtime_harness import metric_value
from usage_harness import complete, healthy, live_pods, service, serving_pods, status, totals_match, usage_condition

pytestmark = pytest.mark.e2e
VERSION = "0.1.0"


def service_series(operator: ChartOperator, namespace: str) -> str:
    """The /metrics of the operator pod that is working (the standby peer has no series of the service)."""
    return next((text for text in operator.metrics() if f'namespace="{namespace}"' in text), "")


def test_status_usage_is_exactly_what_clients_received(operator: ChartOperator, kube: Kubectl,
                                                       namespace: str) -> None:
    kube.apply(service())
    pods = serving_pods(kube, 2)
    eventually(lambda: usage_condition(kube).get("status") == "True", 60, what="UsageHealthy=True")
    tenants = ["team-a", "team-b", "team-a", "team-a"]
    sent = [complete(p["status"]["podIP"], stream=i % 2 == 0, tenant=tenants[i]) for i, p in enumerate(pods * 2)]
    usage = eventually(lambda: totals_match(kube, sent), 30, what="status.usage == client usage")
    assert usage["mismatches"] == 0 and usage["streamMode"] == "incremental" and usage["podsScraped"] == 2
    labels = {"namespace": namespace, "name": "smollm"}

    def exported() -> str:
        text = service_series(operator, namespace)
        return text if metric_value(text, "tally_service_completion_tokens_total", labels) \
            == usage["completionTokens"] else ""

    text = eventually(exported, 30, what="the operator's counters")
    assert metric_value(text, "tally_service_usage_healthy", labels) == 1
    for tenant in ("team-a", "team-b"):  # the operator's series carry the tenant too
        assert metric_value(text, "tally_service_tenant_completion_tokens_total", {**labels, "tenant": tenant}) == \
            sum(u["completion"] for u, t in zip(sent, tenants, strict=True) if t == tenant)

    # a runtime crashes (SIGKILL) and the kubelet restarts it: no negative and no lost usage
    victim = pods[0]
    node_ctr(kube.env, "tasks", "kill", "--signal", "SIGKILL", container_id(victim))
    eventually(lambda: kube.json("get", "pod", victim["metadata"]["name"])["status"]["containerStatuses"][0]
               ["restartCount"] >= 1, 60, what="the runtime restarted by the kubelet")
    serving_pods(kube, 2)
    sent += [complete(victim["status"]["podIP"], stream=True), complete(victim["status"]["podIP"], stream=False)]
    eventually(lambda: totals_match(kube, sent), 30, what="totals exact after a restart")


def legacy_sglang(replicas: int) -> dict[str, Any]:
    """A generation-B SGLang (0.5.9) whose switch did not take effect, served only because it was allowed to:
    the contract fake in the runtime-fakes image, as pods of the real node."""
    manifest = service(replicas=replicas)
    manifest["spec"]["model"]["path"] = "/models/fake"
    manifest["spec"]["engine"] = {
        "kind": "sglang", "image": f"tally-runtime-fakes:{VERSION}", "contextLength": 2048,
        "allowCumulativeStream": True,
        "env": [{"name": "FAKE_SGLANG_VERSION", "value": "0.5.9"}, {"name": "FAKE_SGLANG_IGNORE_SWITCH", "value": "1"}]}
    return manifest


def test_cumulative_pod_is_usage_unhealthy_until_replaced(operator: ChartOperator, kube: Kubectl,
                                                          namespace: str) -> None:
    kube.apply(legacy_sglang(replicas=1))
    serving_pods(kube, 1)
    bad = eventually(lambda: (u := usage_condition(kube)).get("status") == "False" and u, 60,
                     what="UsageHealthy=False")
    assert bad["reason"] == "CumulativeStreaming"
    eventually(lambda: [e for e in kube.json("get", "events")["items"]
                        if e["reason"] == "UsageHealthyFalse" and e["type"] == "Warning"], 30, what="Warning event")
    # the service is rolled onto the CPU engine, which streams incrementally: healthy again (after the streak)
    kube.apply(service(replicas=1))
    good = eventually(lambda: (u := usage_condition(kube)).get("status") == "True" and u, 180,
                      what="UsageHealthy=True again")
    assert good["reason"] == "UsageConsistent"


def test_scrape_failures_never_stall_the_others(operator: ChartOperator, kube: Kubectl,
                                                frozen: list[tuple[dict[str, str], str]]) -> None:
    kube.apply(service(replicas=2))
    hung, good = serving_pods(kube, 2)
    # Both counted first: a pod that never had a reading is scraped only while it is Ready, and a frozen one
    # soon is not.
    eventually(lambda: len((status(kube).get("usage") or {}).get("pods") or []) == 2, 60, what="both pods read")
    # One runtime hangs: its process frozen, connections to it accepted by the kernel but never answered.
    node_ctr(kube.env, "tasks", "pause", container_id(hung))
    frozen.append((kube.env, container_id(hung)))
    assert not healthy(hung["status"]["podIP"])
    ip = good["status"]["podIP"]
    sent = [complete(ip, stream=True)]
    usage = eventually(lambda: (u := status(kube).get("usage") or {}).get("completionTokens") == sent[0]["completion"]
                       and u["podsFailed"] == 1 and u, 60, what="usage from the good pod despite the hung one")
    assert usage["podsScraped"] == 1
    assert len(live_pods(kube)) == 2
    operator.ready()
