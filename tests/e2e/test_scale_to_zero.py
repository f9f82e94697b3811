"""Scale to zero on the real node: a service at zero pods gets 8 concurrent streaming requests through its
Service; the activator holds them, the operator starts a pod at once, and every stream is answered in full;
after the grace the service goes back to zero, and requests that arrive while its last pod drains are held
and answered too; status.usage equals what the clients were told through both
transitions. A request held longer than its hold time (a pod that cannot be scheduled) gets a clear 503."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import openai
import pytest
from kube_harness import Kubectl, eventually, in_cluster, tcp_reaches
from operator_harness import ChartOperator
from usage_harness import MODEL, service, status, totals_match

pytestmark = pytest.mark.e2e

STREAMS = 8
RUNTIME = "serving.tally.dev/completionservice=smollm"
ACTIVATOR = "serving.tally.dev/activator-for=smollm"


def at_zero(grace: int = 15, hold: int = 240, gpus: int = 1) -> dict[str, Any]:
    manifest = service(replicas=1)
    manifest["spec"]["resources"]["gpus"] = gpus
    manifest["spec"]["autoscaling"] = {
        "minReplicas": 0, "maxReplicas": 1, "metric": "queuedRequests", "target": 4, "stableWindowSeconds": 10,
        "panicWindowSeconds": 4, "scaleDownDelaySeconds": 10,
        "scaleToZero": {"graceSeconds": grace, "holdSeconds": hold, "maxHeldRequests": 32, "activatorReplicas": 2}}
    return manifest


def pods(kube: Kubectl, selector: str) -> list[dict[str, Any]]:
    return [p for p in kube.json("get", "pods", "-l", selector)["items"]
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in {"Failed", "Succeeded"}]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def selector(kube: Kubectl) -> dict[str, str]:
    return dict(kube.json("get", "service", "smollm")["spec"]["selector"])


def seconds(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def service_endpoints(kube: Kubectl) -> set[str]:
    """The ready addresses of the Service's EndpointSlices (what kube-proxy sends its connections to)."""
    slices = kube.json("get", "endpointslices", "-l", "kubernetes.io/service-name=smollm")["items"]
    return {address for s in slices for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready") for address in e.get("addresses") or []}


def at_rest(kube: Kubectl) -> bool:
    """Zero runtime pods (none even terminating), two ready activator pods, the Service on the activator, its
    endpoints those two pods, and its ClusterIP taking connections (kube-proxy lags the EndpointSlices: a
    request sent before it catches up got "host unreachable")."""
    runtime = kube.json("get", "pods", "-l", RUNTIME)["items"]
    activators = [p for p in pods(kube, ACTIVATOR) if ready(p)]
    return (not runtime and len(activators) == 2
            and selector(kube) == {"serving.tally.dev/activator-for": "smollm"}
            and service_endpoints(kube) == {p["status"]["podIP"] for p in activators}
            and tcp_reaches(kube.json("get", "service", "smollm")["spec"]["clusterIP"], 8000))


def draining(kube: Kubectl) -> bool:
    """Scaled to zero, and the last pod still terminating."""
    runtime = kube.json("get", "pods", "-l", RUNTIME)["items"]
    return (bool(runtime) and all(p["metadata"].get("deletionTimestamp") for p in runtime)
            and (status(kube).get("autoscaling") or {}).get("desiredReplicas") == 0)


def test_held_streams_are_answered_from_zero_and_the_ledger_is_continuous_through_zero_one_zero(
        operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(at_zero())
    eventually(lambda: at_rest(kube), 180, interval=1, what="no pod, two ready activators, Service on them")
    assert (status(kube).get("autoscaling") or {}).get("desiredReplicas", 0) == 0
    ip = kube.json("get", "service", "smollm")["spec"]["clusterIP"]
    received: list[dict[str, Any]] = []
    failures: list[str] = []
    first_token: list[float] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        with in_cluster(300) as http:
            # the SDK's default retries, as a client has them: a connection refused never reached a server
            sdk = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", http_client=http)
            try:
                usage, text, first = None, "", None
                for chunk in sdk.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"Name {i + 2} colours."}],
                        max_tokens=16, stream=True, stream_options={"include_usage": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                        first = first or time.monotonic()
                    usage = chunk.usage or usage
            except openai.APIError as err:
                with lock:
                    failures.append(f"{type(err).__name__}: {err}")
                return
            assert usage is not None and text
            with lock:
                received.append({"prompt": usage.prompt_tokens, "completion": usage.completion_tokens,
                                 "tenant": "anonymous"})
                first_token.append((first or time.monotonic()) - started)

    started, wall = time.monotonic(), time.time()
    clients = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=300)
    assert not failures, failures
    assert len(received) == STREAMS
    (pod,) = [p for p in kube.json("get", "pods", "-l", RUNTIME)["items"]]
    ready_at = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")
    pod_start = seconds(ready_at) - seconds(pod["metadata"]["creationTimestamp"])
    asked = seconds(pod["metadata"]["creationTimestamp"]) - wall  # held -> the pod created (whole seconds)
    scaling = status(kube).get("autoscaling") or {}
    print(f"\n[scale-to-zero] pod created {asked:.0f}s after the requests; first token after "
          f"{min(first_token):.1f}s (p50 "
          f"{sorted(first_token)[STREAMS // 2]:.1f}s, max {max(first_token):.1f}s); the pod's own start (created "
          f"-> Ready) {pod_start:.0f}s; status coldStartSeconds {scaling.get('coldStartSeconds')}")
    eventually(lambda: selector(kube) == {"serving.tally.dev/completionservice": "smollm"}, 60, interval=1,
               what="the Service back on the pod once it is ready")
    def cold_start_exported() -> bool:
        return any(line.startswith("tally_service_cold_start_seconds{") and f'"{kube.namespace}"' in line
                   and float(line.rsplit(" ", 1)[1]) > 0 for text in operator.metrics() for line in text.splitlines())

    eventually(cold_start_exported, 30, interval=1, what="the cold start on the operator's /metrics")
    # Back to zero after the grace. Requests that come while the last pod drains are held (the Service points
    # at the activator before the scale-down) and start a pod again: answered, never refused
    eventually(lambda: draining(kube), 240, interval=0.25, what="the last pod draining after the grace")
    late = [threading.Thread(target=stream, args=(STREAMS + i,)) for i in range(2)]
    for client in late:
        client.start()
    for client in late:
        client.join(timeout=300)
    assert not failures, failures
    assert len(received) == STREAMS + 2
    eventually(lambda: at_rest(kube), 240, interval=1, what="back to zero after the grace")
    eventually(lambda: totals_match(kube, received), 90, interval=1,
               what="status.usage equal to what the clients were told")
    usage = status(kube).get("usage") or {}
    assert usage.get("podsUnaccounted") == 0, usage
    reasons = kube("get", "events", "-o", "jsonpath={.items[*].reason}").split()
    assert {"ScaledUp", "ScaledDown", "RoutedToPods", "RoutedToActivator"} <= set(reasons), reasons
    assert (status(kube).get("autoscaling") or {}).get("reason") in {"Idle", "ScaledToZero"}


def test_a_request_held_past_its_time_gets_a_clear_503(operator: ChartOperator, kube: Kubectl) -> None:
    """No node has a thousand GPUs: the pod the held request starts never runs, and the request gets the
    OpenAI 503 envelope with Retry-After once its hold time is up."""
    kube.apply(at_zero(hold=3, gpus=1000))
    eventually(lambda: at_rest(kube), 180, interval=1, what="no pod, two ready activators, Service on them")
    ip = kube.json("get", "service", "smollm")["spec"]["clusterIP"]
    with in_cluster(60) as http:
        began = time.monotonic()
        response = http.post(f"http://{ip}:8000/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                        "max_tokens": 4})
        waited = time.monotonic() - began
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "service_starting" and "not billed" in error["message"]
    assert int(response.headers["retry-after"]) >= 1 and waited >= 3
    eventually(lambda: (status(kube).get("autoscaling") or {}).get("desiredReplicas") == 1, 60, interval=1,
               what="the held request asked for a pod")
    assert not status(kube).get("usage", {}).get("requests")
    # Scale to zero switched off: the activator and its Service go, the Service points at the pods again
    kube("patch", "completionservice", "smollm", "--type=merge", "-p", '{"spec":{"autoscaling":{"minReplicas":1}}}')

    def switched_off() -> bool:
        names = kube("get", "deployments,services", "-o", "jsonpath={.items[*].metadata.name}").split()
        ready = next((c for c in status(kube).get("conditions") or [] if c["type"] == "Ready"), {})
        return (sorted(names) == ["smollm", "smollm"] and selector(kube) == {RUNTIME.split("=")[0]: "smollm"}
                and ready.get("reason") not in {"Forbidden", "InvalidChild"})

    eventually(switched_off, 60, interval=1, what="the activator gone and the Service on the pods")



def test_requests_held_at_zero_with_budgets_are_served_not_refused(operator: ChartOperator, kube: Kubectl) -> None:
    """With budgets, a new pod refused everything until its first lease, which came a scrape round after it was
    ready: all 8 held requests were answered 429. A pod is now Ready only once it holds its first lease, so the
    Service turns to it then, and the held requests are served."""
    manifest = at_zero()
    manifest["spec"]["budgets"] = {"default": {"monthlyTokens": 1_000_000}}
    kube.apply(manifest)
    eventually(lambda: at_rest(kube), 180, interval=1, what="no pod, two ready activators, Service on them")
    ip = kube.json("get", "service", "smollm")["spec"]["clusterIP"]
    answers: list[str] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        with in_cluster(300) as http:
            sdk = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", http_client=http, max_retries=0)
            try:
                reply = sdk.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=8)
                outcome = "ok" if reply.usage and reply.usage.completion_tokens else "empty"
            except openai.APIStatusError as err:
                outcome = f"{err.status_code} {err.message[:120]}"
        with lock:
            answers.append(outcome)

    clients = [threading.Thread(target=call, args=(i,)) for i in range(STREAMS)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=300)
    assert answers == ["ok"] * STREAMS, answers
