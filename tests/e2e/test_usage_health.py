"""Usage health end to end: real runtimes on the pods' loopback IPs, scraped by the operator."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from kube_harness import ROOT, Kubectl, eventually
from operator_harness import OperatorProcess
from runtime_harness import metric_value
from usage_harness import (
    PodRunner,
    complete,
    healthy,
    runtime_command,
    service,
    serving_pods,
    status,
    totals_match,
    usage_condition,
)

pytestmark = pytest.mark.e2e
FAKES = ROOT / "tests" / "fakes"


def test_status_usage_is_exactly_what_clients_received(operator: OperatorProcess, runner: PodRunner,
                                                       kube: Kubectl, namespace: str) -> None:
    kube.apply(service())
    pods = serving_pods(kube, 2)
    eventually(lambda: usage_condition(kube).get("status") == "True", 60, what="UsageHealthy=True")
    tenants = ["team-a", "team-b", "team-a", "team-a"]
    sent = [complete(p["status"]["podIP"], stream=i % 2 == 0, tenant=tenants[i]) for i, p in enumerate(pods * 2)]
    usage = eventually(lambda: totals_match(kube, sent), 30, what="status.usage == client usage")
    assert usage["mismatches"] == 0 and usage["streamMode"] == "incremental" and usage["podsScraped"] == 2
    text = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics").text
    labels = {"namespace": namespace, "name": "smollm"}
    assert metric_value(text, "tally_service_completion_tokens_total", labels) == usage["completionTokens"]
    assert metric_value(text, "tally_service_usage_healthy", labels) == 1
    for tenant in ("team-a", "team-b"):  # the operator's series carry the tenant too
        assert metric_value(text, "tally_service_tenant_completion_tokens_total", {**labels, "tenant": tenant}) == \
            sum(u["completion"] for u, t in zip(sent, tenants, strict=True) if t == tenant)

    # a runtime crashes and restarts with its counters at zero: no negative and no lost usage
    victim = pods[0]
    runner.kill(victim["metadata"]["uid"])
    serving_pods(kube, 2)
    sent += [complete(victim["status"]["podIP"], stream=True), complete(victim["status"]["podIP"], stream=False)]
    eventually(lambda: totals_match(kube, sent), 30, what="totals exact after a restart")


def test_cumulative_pod_is_usage_unhealthy_until_replaced(operator: OperatorProcess, runner: PodRunner,
                                                          kube: Kubectl, namespace: str) -> None:
    def legacy_fake(pod: dict[str, Any]) -> list[str]:
        command = runtime_command(pod) or []
        engine = command.index("--engine")
        command[engine + 1] = "sglang"
        # a generation-B SGLang whose switch did not take effect, served only because it was allowed to
        return ["env", f"PYTHONPATH={FAKES}", "FAKE_SGLANG_VERSION=0.5.9", "FAKE_SGLANG_IGNORE_SWITCH=1",
                *command, "--model-path", "/models/fake", "--allow-cumulative-stream"]

    runner.overrides[namespace] = legacy_fake  # type: ignore[attr-defined]
    kube.apply(service(replicas=1))
    serving_pods(kube, 1)
    bad = eventually(lambda: (u := usage_condition(kube)).get("status") == "False" and u, 60,
                     what="UsageHealthy=False")
    assert bad["reason"] == "CumulativeStreaming"
    eventually(lambda: [e for e in kube.json("get", "events")["items"]
                        if e["reason"] == "UsageHealthyFalse" and e["type"] == "Warning"], 30, what="Warning event")
    # the pod is replaced by one that streams incrementally: healthy again (after the hysteresis streak)
    del runner.overrides[namespace]  # type: ignore[attr-defined]
    kube("delete", "pods", "--all", "--wait=false")
    good = eventually(lambda: (u := usage_condition(kube)).get("status") == "True" and u, 120,
                      what="UsageHealthy=True again")
    assert good["reason"] == "UsageConsistent"


def test_scrape_failures_never_stall_the_others(operator: OperatorProcess, runner: PodRunner, kube: Kubectl,
                                                namespace: str, tmp_path: Path) -> None:
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import http.server, sys, time\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        time.sleep(30) if self.path == '/metrics' else None\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'garbage {{{')\n"
        "http.server.ThreadingHTTPServer((sys.argv[1], 8000), H).serve_forever()\n")
    chosen: list[str] = []

    def one_slow(pod: dict[str, Any]) -> list[str] | None:
        if not chosen or chosen[0] == pod["metadata"]["uid"]:
            chosen[:1] = [pod["metadata"]["uid"]]
            return [sys.executable, str(slow), pod["status"]["podIP"]]
        return runtime_command(pod)

    runner.overrides[namespace] = one_slow  # type: ignore[attr-defined]
    kube.apply(service(replicas=2))

    def the_good_pod() -> str:
        pods = [p for p in kube.json("get", "pods")["items"] if p["status"].get("podIP")]
        others = [p["status"]["podIP"] for p in pods if chosen and p["metadata"]["uid"] != chosen[0]]
        return others[0] if len(pods) == 2 and others else ""

    ip = eventually(the_good_pod, 60, what="two pods, one of them slow")
    eventually(lambda: healthy(ip), 120, what="the good pod's runtime")
    sent = [complete(ip, stream=True)]
    usage = eventually(lambda: (u := status(kube).get("usage") or {}).get("completionTokens") == sent[0]["completion"]
                       and u["podsFailed"] == 1 and u, 60, what="usage from the good pod despite the slow one")
    assert usage["podsScraped"] == 1
    assert operator.alive()
