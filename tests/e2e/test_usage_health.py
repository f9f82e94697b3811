"""Usage health end to end: real runtimes on the pods' loopback IPs, scraped by the operator."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from kube_harness import ROOT, Kubectl, eventually
from operator_harness import OperatorProcess
from runtime_harness import metric_value

sys.path.insert(0, str(ROOT / "hack"))
from pod_runner import PodRunner, runtime_command

pytestmark = pytest.mark.e2e
FAKES = ROOT / "tests" / "fakes"


@pytest.fixture(scope="module")
def runner(kube_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodRunner]:
    overrides: dict[str, Any] = {}

    def command_for(pod: dict[str, Any]) -> list[str] | None:
        hook = overrides.get(pod["metadata"]["namespace"])
        return hook(pod) if hook else runtime_command(pod)

    pods = PodRunner(kube_env, tmp_path_factory.mktemp("pods"), command_for=command_for)
    pods.overrides = overrides  # type: ignore[attr-defined]
    thread = threading.Thread(target=pods.run, daemon=True)
    thread.start()
    yield pods
    pods.close()
    thread.join(timeout=30)


def service(name: str = "smollm", replicas: int = 2) -> dict[str, Any]:
    manifest = yaml.safe_load((ROOT / "crds" / "examples" / "smollm-cpu.yaml").read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["replicas"] = replicas
    manifest["spec"]["usageHealth"] = {"scrapeIntervalSeconds": 1}
    return dict(manifest)


def status(kube: Kubectl, name: str = "smollm") -> dict[str, Any]:
    return dict(kube.json("get", "completionservice", name).get("status") or {})


def usage_condition(kube: Kubectl, name: str = "smollm") -> dict[str, Any]:
    return next((c for c in status(kube, name).get("conditions") or [] if c["type"] == "UsageHealthy"), {})


def serving_pods(kube: Kubectl, count: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]]:
        pods = [p for p in kube.json("get", "pods")["items"] if p["status"].get("podIP")
                and not p["metadata"].get("deletionTimestamp")]
        healthy = [p for p in pods if _healthy(p["status"]["podIP"])]
        return healthy if len(healthy) == count else []

    return list(eventually(ready, 120, interval=0.5, what=f"{count} runtimes serving on pod IPs"))


def _healthy(ip: str) -> bool:
    try:
        return httpx.get(f"http://{ip}:8000/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def complete(ip: str, stream: bool, prompt: str = "Tell me a joke", max_tokens: int = 6) -> dict[str, int]:
    client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", max_retries=0)
    if not stream:
        reply = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=max_tokens)
        assert reply.usage is not None
        return {"prompt": reply.usage.prompt_tokens, "completion": reply.usage.completion_tokens}
    usage = None
    for chunk in client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=max_tokens,
                                           stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage is not None
    return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens}


def totals_match(kube: Kubectl, sent: list[dict[str, int]]) -> dict[str, Any]:
    usage = status(kube).get("usage") or {}
    expected = (len(sent), sum(u["prompt"] for u in sent), sum(u["completion"] for u in sent))
    return usage if (usage.get("requests"), usage.get("promptTokens"), usage.get("completionTokens")) == expected \
        else {}


def test_status_usage_is_exactly_what_clients_received(operator: OperatorProcess, runner: PodRunner,
                                                       kube: Kubectl, namespace: str) -> None:
    kube.apply(service())
    pods = serving_pods(kube, 2)
    eventually(lambda: usage_condition(kube).get("status") == "True", 60, what="UsageHealthy=True")
    sent = [complete(p["status"]["podIP"], stream=i % 2 == 0) for i, p in enumerate(pods * 2)]
    usage = eventually(lambda: totals_match(kube, sent), 30, what="status.usage == client usage")
    assert usage["mismatches"] == 0 and usage["streamMode"] == "incremental" and usage["podsScraped"] == 2
    text = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics").text
    labels = {"namespace": namespace, "name": "smollm"}
    assert metric_value(text, "tally_service_completion_tokens", labels) == usage["completionTokens"]
    assert metric_value(text, "tally_service_usage_healthy", labels) == 1

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
    eventually(lambda: _healthy(ip), 120, what="the good pod's runtime")
    sent = [complete(ip, stream=True)]
    usage = eventually(lambda: (u := status(kube).get("usage") or {}).get("completionTokens") == sent[0]["completion"]
                       and u["podsFailed"] == 1 and u, 60, what="usage from the good pod despite the slow one")
    assert usage["podsScraped"] == 1
    assert operator.alive()
