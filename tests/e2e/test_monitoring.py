"""Monitoring as a platform team runs it, against a real Prometheus scraping the real pods: the README's
monthly-tenant query returns exactly the tokens the clients received (across a container restart and a
scale-down), every dashboard panel's query parses and returns data, and the alert rules pass promtool's
own tests."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from kube_harness import ROOT, Kubectl, container_id, eventually, node_ctr
from operator_harness import ChartOperator
from prometheus_harness import Prometheus, prometheus
from usage_harness import complete, service, serving_pods, totals_match

pytestmark = pytest.mark.e2e

MONITORING = ROOT / "charts" / "tally-operator" / "monitoring"


def readme_query(namespace: str, tenant: str) -> str:
    """The README's query for a tenant's tokens over the last 30 days, word for word but for the names."""
    text = (ROOT / "README.md").read_text()
    query = re.search(r"```promql\n(.*?)```", text, re.S)
    assert query is not None, "the README lost its PromQL"
    return query.group(1).replace('namespace="team-a"', f'namespace="{namespace}"').replace('tenant="acme"',
                                                                                             f'tenant="{tenant}"')


def test_the_alert_rules_pass_promtools_checks_and_tests(kube_env: dict[str, str]) -> None:
    promtool = Path(kube_env["PATH"].split(":")[0]) / "promtool"
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
        done = subprocess.run([str(promtool), *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def prom(kube_env: dict[str, str], tmp_path: Path) -> Iterator[Prometheus]:
    with prometheus(kube_env, tmp_path) as server:
        yield server


def restart_container(kube: Kubectl, pod: dict[str, Any]) -> None:
    before = pod["status"]["containerStatuses"][0]["restartCount"]
    node_ctr(kube.env, "tasks", "kill", "--signal", "SIGKILL", container_id(pod))
    eventually(lambda: kube.json("get", "pod", pod["metadata"]["name"])["status"]["containerStatuses"][0]
               ["restartCount"] > before, 60, what="the runtime restarted by the kubelet")


def test_a_tenants_month_in_promql_is_exactly_what_its_clients_received(
        operator: ChartOperator, kube: Kubectl, prom: Prometheus) -> None:
    manifest = service(replicas=2)
    manifest["spec"]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 2}  # the scaling gauges, held at 2
    manifest["spec"]["budgets"] = {"default": {"monthlyTokens": 10**12}}  # the budget panel's series
    kube.apply(manifest)
    pods = serving_pods(kube, 2)
    sent: list[dict[str, int]] = []
    acme: list[dict[str, int]] = []

    def serve(ip: str, tenant: str, stream: bool) -> None:
        # a 429 (no lease yet on a new pod) costs nothing and is not counted: the request is sent again
        def once() -> dict[str, Any] | None:
            try:
                return complete(ip, stream=stream, tenant=tenant)
            except openai.RateLimitError:
                return None

        usage = eventually(once, 60, interval=1, what="a request served under a lease")
        sent.append(usage)
        if tenant == "acme":
            acme.append(usage)

    for pod in pods:
        serve(pod["status"]["podIP"], "acme", True)
        serve(pod["status"]["podIP"], "other-team", False)
    eventually(lambda: totals_match(kube, sent), 60, what="status.usage exact")
    restart_container(kube, pods[0])  # the pod's journal carries its counters on
    pods = serving_pods(kube, 2)
    serve(pods[0]["status"]["podIP"], "acme", False)
    manifest["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}  # a scale-down: a pod drains and goes
    kube.apply(manifest)
    pods = serving_pods(kube, 1)
    serve(pods[0]["status"]["podIP"], "acme", True)
    eventually(lambda: totals_match(kube, sent), 90, what="status.usage exact after the restart and the scale-down")
    expected = sum(u["prompt"] + u["completion"] for u in acme)
    query = readme_query(kube.namespace or "", "acme")
    try:
        month = eventually(lambda: (v := prom.value(query)) == expected and v, 60, interval=1,
                           what=f"the README's query at {expected} tokens")
    except AssertionError as failure:
        raise AssertionError(f"{failure}: it says {prom.value(query)}; targets {prom.targets()}") from None
    assert month == expected

    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$namespace", kube.namespace or "").replace("$__rate_interval", "1m") \
                .replace("$service", ".*")
            if panel.get("description", "").startswith("Empty "):  # an incident's panel: none here, but it parses
                prom.query(expr)
                continue
            assert eventually(lambda e=expr: prom.query(e), 60, interval=1, what=f"data for {panel['title']!r}")
    rules = prom.api("rules")["data"]["groups"]
    shipped = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    assert {g["name"] for g in rules} == {g["name"] for g in shipped["groups"]} >= {"tally.billing", "tally.serving"}


def test_the_chart_renders_its_monitoring_objects_only_when_asked(kubectl: Kubectl) -> None:

    chart = ROOT / "charts" / "tally-operator"

    def render(*sets: str) -> list[dict[str, Any]]:
        args = [arg for s in sets for arg in ("--set", s)]
        out = subprocess.run(["helm", "template", "t", str(chart), *args], check=True, capture_output=True,
                             text=True, env=kubectl.env).stdout
        return [o for o in yaml.safe_load_all(out) if o]

    kinds = {o["kind"] for o in render()}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}  # their CRDs may be absent
    enabled = [f"monitoring.{part}.enabled=true" for part in ("podMonitor", "serviceMonitor", "prometheusRule",
                                                              "dashboard")]
    objects = {o["kind"]: o for o in render(*enabled, "monitoring.labels.release=kube-prometheus-stack")}
    assert objects["PrometheusRule"]["spec"] == yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    assert objects["PodMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert objects["ServiceMonitor"]["spec"]["endpoints"][0]["honorLabels"] is True
    dashboard = objects["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tally.json"]) == json.loads((MONITORING / "dashboard.json").read_text())
    # Runbook links, when the README's address is given: each alert to its own row of the README's alert table
    base = "https://git.example.com/tally/README.md"
    rule = {o["kind"]: o for o in render(*enabled, f"monitoring.prometheusRule.runbookUrl={base}")}["PrometheusRule"]
    readme = (ROOT / "README.md").read_text()
    for group in rule["spec"]["groups"]:
        for alert in group["rules"]:
            link = alert["annotations"]["runbook_url"]
            assert link == f"{base}#{alert['alert'].lower()}" and f'<a id="{alert["alert"].lower()}"></a>' in readme
