"""Record delivery owned by the platform, on the real node: the chart names the billing system (a receiver in
the operator's own namespace, its token a Secret there), the operator collects every pod's records and
forwards them. The receiver is down for longer than a pod's spool holds under a steady load: no pod is
evicted (the spool drops its oldest records and counts them, with an Event; the volume is sized from the
spool), and afterwards every record written is either delivered or counted lost. A user of the serving
namespace cannot read the billing system's token."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
from kube_harness import Kubectl, eventually, in_cluster
from operator_harness import NAMESPACE, SUITE_SETTINGS, ChartOperator, install_chart
from usage_harness import MODEL, service, serving_pods

pytestmark = pytest.mark.e2e
SPOOL_KIB = 64  # about 100 records: the outage below writes more
RECEIVER = r'''
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
TOKEN = open("/etc/meter/token").read().strip()
state = {"events": {}, "posts": 0, "failing": False}
lock = threading.Lock()
class Handler(BaseHTTPRequestHandler):
    def reply(self, code, body=b""):
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/failing/"):
            state["failing"] = self.path.endswith("/on"); return self.reply(200)
        with lock:
            state["posts"] += 1
            if state["failing"] or self.headers.get("Authorization") != "Bearer " + TOKEN:
                return self.reply(503)
            for event in json.loads(body):
                state["events"][event["id"]] = event["source"]
        self.reply(202)
    def do_GET(self):
        with lock:
            self.reply(200, json.dumps({"events": state["events"], "posts": state["posts"]}).encode())
    def log_message(self, *_):
        pass
ThreadingHTTPServer(("", 8080), Handler).serve_forever()
'''


def receiver_objects(token: str) -> list[dict[str, Any]]:
    labels = {"app": "meter"}
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "meter-token"}, "stringData": {"token": token}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "meter"},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"containers": [{"name": "meter", "image": "tally-client:0.1.0", "command": ["python3", "-c",
                                                                                                   RECEIVER],
                                      "ports": [{"containerPort": 8080}],
                                      "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                                          "capabilities": {"drop": ["ALL"]},
                                                          "seccompProfile": {"type": "RuntimeDefault"}},
                                      "volumeMounts": [{"name": "token", "mountPath": "/etc/meter"}]}],
                      "volumes": [{"name": "token", "secret": {"secretName": "meter-token"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "meter"},
         "spec": {"selector": labels, "ports": [{"port": 8080, "targetPort": 8080}]}},
    ]


def complete(ip: str, i: int) -> str:
    """One completion; its response id (the record's event id)."""
    with in_cluster(120) as http:
        reply = http.post(f"http://{ip}:8000/v1/completions", headers={"X-Tally-Tenant": "acme"},
                          json={"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        return str(reply.json()["id"])


def test_the_platform_delivers_through_an_outage_with_no_pod_evicted_and_every_record_accounted_for(
        operator: ChartOperator, kubectl: Kubectl, kube: Kubectl, namespace: str) -> None:
    system = kubectl.in_namespace(NAMESPACE)
    token = secrets.token_hex(16)
    for obj in receiver_objects(token):
        system.apply(obj)
    meter = f"http://meter.{NAMESPACE}.svc.cluster.local:8080"
    install_chart(kubectl, operator.replicas, *SUITE_SETTINGS, f"usageRecords.delivery.url={meter}/api/v1/events",
                  "usageRecords.delivery.tokenSecret.name=meter-token", f"usageRecords.spoolKiB={SPOOL_KIB}",
                  "usageRecords.delivery.allowServiceDelivery=false")
    try:
        operator.ready()
        system("rollout", "status", "deployment/meter", "--timeout=180s")
        receiver_ip = system.json("get", "pods", "-l", "app=meter")["items"][0]["status"]["podIP"]

        def receiver(path: str = "/", method: str = "GET") -> dict[str, Any]:
            with in_cluster(30) as http:
                reply = http.request(method, f"http://{receiver_ip}:8080{path}")
                return dict(json.loads(reply.text or "{}")) if method == "GET" else {}

        kube.apply(service("smollm", replicas=1))
        pod = serving_pods(kube, 1)[0]
        ip, uid = pod["status"]["podIP"], pod["metadata"]["uid"]
        written = [complete(ip, i) for i in range(5)]
        eventually(lambda: set(written) <= set(receiver()["events"]), 120, interval=1,
                   what="the first records forwarded")
        receiver("/failing/on", "POST")  # the billing system is down
        written += [complete(ip, i) for i in range(5, 205)]  # more than the spool holds
        lost = eventually(lambda: _lost(operator, ip), 60, interval=1, what="records counted lost")
        receiver("/failing/off", "POST")
        eventually(lambda: _queued(ip) == 0, 300, interval=2, what="the spool collected")
        delivered = receiver()["events"]
        assert set(delivered) <= set(written)
        assert len(delivered) + lost == len(written), (len(delivered), lost, len(written))
        assert all(source.startswith(f"/namespaces/{namespace}/completionservices/smollm/pods/")
                   for source in delivered.values())
        now = kube.json("get", "pod", pod["metadata"]["name"])
        assert now["metadata"]["uid"] == uid and now["status"]["containerStatuses"][0]["restartCount"] == 0
        assert now["status"].get("phase") == "Running"  # never evicted
        events = kube.json("get", "events", "--field-selector", "reason=UsageRecordsLost")["items"]
        assert events, "no UsageRecordsLost Event"
        # A user of the serving namespace (its edit role) cannot read the billing system's token
        kube("create", "rolebinding", "team-edit", "--clusterrole=edit", f"--serviceaccount={namespace}:team")
        user = f"system:serviceaccount:{namespace}:team"
        assert kube("auth", "can-i", "get", "secret/meter-token", "-n", NAMESPACE, f"--as={user}",
                    check=False).strip() == "no"
        assert kube("auth", "can-i", "get", "secrets", f"--as={user}", check=False).strip() == "yes"  # its own
    finally:
        install_chart(kubectl, operator.replicas, *SUITE_SETTINGS)
        for obj in receiver_objects(token):
            system("delete", obj["kind"].lower(), obj["metadata"]["name"], "--wait=false", check=False)


def _metric(ip: str, name: str, labels: str = "") -> float:
    with in_cluster(10) as http:
        text = http.get(f"http://{ip}:8001/metrics").text
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


def _lost(_: ChartOperator, ip: str) -> int:
    return int(_metric(ip, "tally_usage_records_lost_total", '{sink="delivery"}'))


def _queued(ip: str) -> float:
    return _metric(ip, "tally_usage_records_queued")
