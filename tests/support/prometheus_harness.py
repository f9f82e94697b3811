"""A real Prometheus (3.x, hack/build.sh) inside the tests' cluster network namespace, scraping what the chart's
PodMonitor and ServiceMonitor would: the runtime pods' metrics port as job tally-runtime, the operator's
metrics port as job tally-operator, found through the real API server (Kubernetes service discovery).
Anchored range selectors are on (an exact `increase`), and so is zero ingestion at a counter's created time
(a series that begins within a range counts from zero)."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kube_harness import ROOT, TEST_CLUSTER, cluster_netns, eventually

LISTEN = "127.0.0.1:19090"  # inside the cluster's namespace: reached with nsenter, never from this machine
RULES = ROOT / "charts" / "tally-operator" / "monitoring" / "alerts.yaml"


def config(kubeconfig: Path, interval: str = "1s") -> dict[str, Any]:
    def job(name: str, keep: tuple[str, str], port: str, honor_labels: bool = False) -> dict[str, Any]:
        label, value = keep
        return {
            "job_name": name, "scrape_interval": interval, "honor_labels": honor_labels,
            "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig)}],
            "relabel_configs": [
                {"source_labels": [f"__meta_kubernetes_pod_label_{label}"], "regex": value, "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port, "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_label_serving_tally_dev_completionservice"],
                 "target_label": "service"},
            ],
        }

    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(RULES)],
            "scrape_configs": [job("tally-runtime", ("app_kubernetes_io_component", "completion-service"), "metrics"),
                               # the operator's series name their service's namespace: theirs wins (as the
                               # chart's ServiceMonitor says with honorLabels)
                               job("tally-operator", ("app_kubernetes_io_name", "tally-operator"), "metrics",
                                   honor_labels=True)]}


class Prometheus:
    def __init__(self, netns: str) -> None:
        self.netns = netns

    def api(self, path: str, **params: str) -> Any:
        url = f"http://{LISTEN}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        done = subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", "curl", "-s", "--max-time", "20", url],
                              capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout or "{}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; a query Prometheus cannot parse or run fails the test."""
        reply = self.api("query", query=expr)
        assert reply.get("status") == "success", f"{expr}: {reply.get('error', reply)}"
        return list(reply["data"]["result"])

    def targets(self) -> list[str]:
        """Each scrape target as `job url health error`, to say what Prometheus saw when a query is empty."""
        active = (self.api("targets").get("data") or {}).get("activeTargets") or []
        return [f"{t['labels'].get('job')} {t['scrapeUrl']} {t['health']} {t.get('lastError', '')[:120]}"
                for t in active]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@contextmanager
def prometheus(env: dict[str, str], workdir: Path) -> Iterator[Prometheus]:
    binary = Path(env["PATH"].split(":")[0]) / "prometheus"
    cluster = Path(TEST_CLUSTER["TALLY_CLUSTER_DIR"])
    (workdir / "prometheus.yml").write_text(json.dumps(config(cluster / "cluster.kubeconfig")))
    netns = cluster_netns()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", str(binary),
                             f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address={LISTEN}",
                             "--enable-feature=promql-extended-range-selectors,created-timestamp-zero-ingestion"],
                            stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(netns)
    try:
        eventually(lambda: server.api("status/buildinfo").get("status") == "success", 60, interval=0.5,
                   what=f"Prometheus ready (log: {workdir / 'prometheus.log'})")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
