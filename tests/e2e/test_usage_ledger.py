"""The usage ledger end to end: status.usage equals what the clients received, through every pod and
operator lifecycle event a service lives through (steady state, a pod deleted mid-stream and right after
serving, a runtime crash, a scale-down, the operators killed while pods serve, a pod hung and unready),
with the runtimes and the operator as pods of the real node.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any

import httpx
import pytest
from kube_harness import Kubectl, container_id, eventually, in_cluster, node_ctr, node_exec
from operator_harness import ChartOperator
from runtime_harness import sse_payloads
from usage_harness import MODEL, billed, complete, ledger_tenants, service, serving_pods, status, totals_match

pytestmark = pytest.mark.e2e
TENANTS = ("team-a", "team-b")


def ip(pod: dict[str, Any]) -> str:
    return str(pod["status"]["podIP"])


def others(kube: Kubectl, gone: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The serving pods once `gone` is no longer one of them."""
    def check() -> list[dict[str, Any]]:
        pods = serving_pods(kube, count)
        return pods if all(p["metadata"]["uid"] != gone["metadata"]["uid"] for p in pods) else []

    return list(eventually(check, 120, interval=0.5, what="a replacement pod serving"))


def stream_through_shutdown(pod_ip: str, kube: Kubectl, pod_name: str) -> dict[str, int]:
    """A stream in flight when its pod is deleted: it must still end with [DONE] and its usage."""
    body = {"model": MODEL, "prompt": "Write a long story:", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with in_cluster(120) as http, http.stream("POST", f"http://{pod_ip}:8000/v1/completions", json=body) as response:
        chunks = iter(response.iter_bytes())
        received = [next(chunks)]
        kube("delete", "pod", pod_name, "--wait=false")
        received.extend(chunks)
    events = sse_payloads(b"".join(received))
    assert events[-1] == "[DONE]", "the stream was cut by the shutdown"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 40
    return {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"]}


def ready_condition(kube: Kubectl, pod: dict[str, Any]) -> str:
    current = kube.json("get", "pod", pod["metadata"]["name"])
    return next((c["status"] for c in current["status"].get("conditions") or [] if c["type"] == "Ready"), "")


def crash(kube: Kubectl, pod: dict[str, Any]) -> None:
    """SIGKILL the runtime (no drain, no final read); the kubelet restarts it on the same pod volume."""
    before = pod["status"]["containerStatuses"][0]["restartCount"]
    node_ctr(kube.env, "tasks", "kill", "--signal", "SIGKILL", container_id(pod))
    eventually(lambda: kube.json("get", "pod", pod["metadata"]["name"])["status"]["containerStatuses"][0]
               ["restartCount"] > before, 60, what="the runtime restarted by the kubelet")


def exact(kube: Kubectl, sent: list[dict[str, Any]], what: str, deadline: float = 60) -> dict[str, Any]:
    """status.usage, once its totals and every tenant's equal what the clients were told."""
    clients = (len(sent), sum(u["prompt"] for u in sent), sum(u["completion"] for u in sent))
    try:
        usage = eventually(lambda: totals_match(kube, sent), deadline, interval=0.5, what=f"status.usage {what}")
    except AssertionError as failure:
        got = {k: v for k, v in (status(kube).get("usage") or {}).items() if k not in {"pods", "tenants"}}
        raise AssertionError(f"{failure}; clients received (requests, prompt, completion) {clients}, "
                             f"per tenant {billed(sent)}; status.usage is {got}, per tenant "
                             f"{ledger_tenants(status(kube).get('usage') or {})}") from None
    return dict(usage)


def test_status_usage_equals_what_clients_received_through_every_lifecycle_event(
        operator: ChartOperator, kube: Kubectl, frozen: list[tuple[dict[str, str], str]]) -> None:
    kube.apply(service(replicas=2))
    pods = serving_pods(kube, 2)
    sent = [complete(ip(p), stream=i % 2 == 0, tenant=TENANTS[i % 2]) for i, p in enumerate(pods * 2)]
    exact(kube, sent, "in steady state")

    # a pod deleted while it streams: the stream finishes, the pod drains and is read a last time
    victim = pods[0]
    sent.append(stream_through_shutdown(ip(victim), kube, victim["metadata"]["name"]))
    pods = others(kube, victim, 2)
    exact(kube, sent, "after a pod was deleted mid-stream")

    # a pod deleted right after serving
    victim = pods[0]
    sent.append(complete(ip(victim), stream=True, tenant=TENANTS[1]))
    kube("delete", "pod", victim["metadata"]["name"], "--wait=false")
    pods = others(kube, victim, 2)
    exact(kube, sent, "after a pod was deleted right after serving")

    # the runtime process killed right after serving: the container restarts on the same pod volume
    victim = pods[1]
    sent.append(complete(ip(victim), stream=False))
    crash(kube, victim)
    pods = serving_pods(kube, 2)
    sent.append(complete(ip(victim), stream=True))
    exact(kube, sent, "after a runtime crash")

    # scale 2 -> 1 right after both pods served
    sent += [complete(ip(p), stream=True) for p in pods]
    kube("scale", "completionservice", "smollm", "--replicas=1")
    pods = serving_pods(kube, 1)
    exact(kube, sent, "after a scale-down")

    # both operators SIGKILLed; the pod serves while none runs; the kubelet restarts them
    killed = operator.kill()
    sent += [complete(ip(pods[0]), stream=i == 0, tenant=TENANTS[i]) for i in range(2)]
    operator.restarted(killed)
    # kopf's peering keeps a killed operator's record for a while; the new ones may wait it out first
    exact(kube, sent, "after the operators were killed and restarted", deadline=180)

    # the pod hangs (frozen) until its readiness probe fails, then comes back: it serves what reaches it
    # while still unready, the rounds that could not read it lose nothing, and nothing is counted twice
    pod = pods[0]
    node_ctr(kube.env, "tasks", "pause", container_id(pod))
    frozen.append((kube.env, container_id(pod)))
    eventually(lambda: ready_condition(kube, pod) == "False", 60, interval=0.5, what="the hung pod unready")
    node_ctr(kube.env, "tasks", "resume", frozen.pop()[1])
    sent.append(complete(ip(pod), stream=True))
    sent.append(complete(ip(pod), stream=False))
    usage = exact(kube, sent, "after a pod was hung and unready")
    assert usage["podsUnaccounted"] == 0 and usage["mismatches"] == 0


def test_concurrent_streams_across_a_pod_deletion_are_all_counted(
        operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(service(replicas=1))
    pod = serving_pods(kube, 1)[0]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        others_ = [pool.submit(complete, ip(pod), True, f"Story {i}:", 24) for i in range(2)]
        mine = stream_through_shutdown(ip(pod), kube, pod["metadata"]["name"])
        sent = [mine, *(f.result(timeout=120) for f in others_)]
    exact(kube, sent, "after a deletion with several streams in flight")


def test_a_pod_read_by_others_while_it_drains_is_still_booked_exactly(
        operator: ChartOperator, kube: Kubectl) -> None:
    """A Prometheus (or anyone) reading /metrics of a draining pod ends nothing: only the operator's
    acknowledgement of the final counters lets the runtime exit."""
    kube.apply(service(replicas=1))
    pod = serving_pods(kube, 1)[0]
    sent = [complete(ip(pod), stream=True)]
    exact(kube, sent, "before")
    sent.append(complete(ip(pod), stream=True))  # served right before the deletion: only the final read has it
    stop = threading.Event()

    def hammer() -> None:
        with in_cluster(2) as http:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    http.get(f"http://{ip(pod)}:8001/metrics")  # where Prometheus would read it
                stop.wait(0.1)

    reader = threading.Thread(target=hammer, daemon=True)
    reader.start()
    try:
        kube("delete", "pod", pod["metadata"]["name"], "--wait=false")
        others(kube, pod, 1)
        usage = exact(kube, sent, "after a deletion while another reader read /metrics every 100 ms")
    finally:
        stop.set()
        reader.join(timeout=10)
    assert usage["podsUnaccounted"] == 0


PEER = "tally-operator-peer"


def start_peer(operator: ChartOperator) -> None:
    """A third operator replica that outranks the chart's two (the highest peering priority)."""
    chart = operator.system.json("get", "deployment", "tally-operator")
    labels = {"app.kubernetes.io/name": "tally-operator", "app.kubernetes.io/instance": PEER}
    spec = chart["spec"]
    spec["replicas"] = 1
    spec["selector"] = {"matchLabels": labels}
    spec["template"]["metadata"]["labels"] = labels
    container = spec["template"]["spec"]["containers"][0]
    container["args"] = [*container.get("args", []), f"--priority={2**31 - 1}"]
    paused = operator.logs().count("Pausing operations in favour of")  # the chart's standby already did
    operator.system.apply({"apiVersion": "apps/v1", "kind": "Deployment",
                           "metadata": {"name": PEER, "namespace": chart["metadata"]["namespace"]}, "spec": spec})
    operator.system("rollout", "status", f"deployment/{PEER}", "--timeout=180s")
    eventually(lambda: operator.logs().count("Pausing operations in favour of") > paused, 90, interval=1,
               what="the chart's active operator pausing for the higher-priority peer")


def stop_peer(operator: ChartOperator, paused_logs: int) -> None:
    operator.system("delete", "deployment", PEER, "--wait=true", "--timeout=120s")
    eventually(lambda: operator.logs().count("Resuming operations after the pause") > paused_logs, 120,
               interval=1, what="the chart's operator resuming after the peer left")


def evict(kube: Kubectl, pod: dict[str, Any]) -> None:
    """A real eviction by the kubelet: the pod's ledger emptyDir is filled past its sizeLimit."""
    node_exec(kube.env, container_id(pod), "sh", "-c", "head -c 24M /dev/zero > /var/lib/tally/fill")
    # Evicted, the pod keeps its IP and ends Failed, or Succeeded when the runtime got its final read in
    # the eviction's short grace and exited cleanly: terminal either way.
    eventually(lambda: kube.json("get", "pod", pod["metadata"]["name"])["status"].get("phase")
               in {"Failed", "Succeeded"}, 120, interval=1, what=f"the pod {pod['metadata']['name']} evicted")
    events = kube("get", "events", "--field-selector", f"involvedObject.name={pod['metadata']['name']}")
    assert "exceeds the limit" in events  # the kubelet's eviction, not anything else


def test_usage_is_exact_through_a_peering_handover_a_replacement_and_an_eviction(
        operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(service(replicas=1))
    pod = serving_pods(kube, 1)[0]
    sent = [complete(ip(pod), stream=True)]
    seen = [exact(kube, sent, "before the handover")]
    resumed_before = operator.logs().count("Resuming operations after the pause")
    start_peer(operator)
    try:
        # the old active one is paused: the peer books a pod that serves and is replaced
        sent.append(complete(ip(pod), stream=False))
        seen.append(exact(kube, sent, "booked by the peer"))
        sent.append(complete(ip(pod), stream=True))
        kube("delete", "pod", pod["metadata"]["name"], "--wait=false")
        pod = others(kube, pod, 1)[0]
        sent.append(complete(ip(pod), stream=True))
        seen.append(exact(kube, sent, "after a replacement under the peer"))
    finally:
        stop_peer(operator, resumed_before)
    sent.append(complete(ip(pod), stream=True))  # the old active one resumed on its old memory
    seen.append(exact(kube, sent, "after the old active operator resumed"))
    evict(kube, pod)
    pod = others(kube, pod, 1)[0]
    sent.append(complete(ip(pod), stream=True))
    seen.append(exact(kube, sent, "after an eviction"))
    totals = [u["completionTokens"] for u in seen]
    assert totals == sorted(totals) and [u["sequence"] for u in seen] == sorted(u["sequence"] for u in seen)
    assert seen[-1]["podsUnaccounted"] <= 1  # the evicted pod's last reading was not final: nothing else was lost


def test_a_deployment_deleted_as_an_orphan_and_recreated_books_its_pods_once(
        operator: ChartOperator, kube: Kubectl) -> None:
    """`kubectl delete deploy --cascade=orphan` used to drop the pods' readings (their Deployment was gone, so
    they were not counted); the re-created Deployment adopted them and each was booked whole again."""
    kube.apply(service(replicas=1))
    pod = serving_pods(kube, 1)[0]
    sent = [complete(ip(pod), stream=True), complete(ip(pod), stream=False)]
    exact(kube, sent, "before the orphaning")
    kube("delete", "deployment", "smollm", "--cascade=orphan")
    # The operator re-creates it (the next full pass), which adopts the orphaned ReplicaSet and its pod
    adopted = eventually(lambda: kube.json("get", "deployment", "smollm")["status"].get("readyReplicas") == 1, 120,
                         interval=1, what="the Deployment re-created and its pod re-adopted")
    assert adopted
    assert serving_pods(kube, 1)[0]["metadata"]["uid"] == pod["metadata"]["uid"]  # the same pod, adopted
    sent.append(complete(ip(pod), stream=True))
    exact(kube, sent, "after the re-adoption: the pod's history booked once")
    assert (status(kube).get("usage") or {}).get("podsUnaccounted") == 0


def tenant_series(text: str, namespace: str, field: str = "completion_tokens") -> dict[str, float]:
    """An operator's tally_service_tenant_<field>_total series of service smollm, per tenant."""
    series = {}
    for line in text.splitlines():
        if line.startswith(f"tally_service_tenant_{field}_total{{") and 'name="smollm"' in line \
                and f'namespace="{namespace}"' in line:
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            series[tenant] = float(line.rsplit(" ", 1)[1])
    return series


def test_a_pod_deleted_while_every_operator_is_down_is_booked_per_tenant_and_a_forged_hand_off_is_refused(
        operator: ChartOperator, kube: Kubectl, frozen: list[tuple[dict[str, str], str]]) -> None:
    """Two tenants (API keys) stream through two pods; every operator is SIGKILLed and, restarted, paused; a
    serving pod is deleted while none works and drains; another pod reads its final counters and posts them
    back (a forged acknowledgement): refused, the pod keeps waiting, and the operator books it once it is
    back. The totals and every tenant's equal what its clients were told, and the restarted operator's tenant
    series equal the ledger."""
    keys = {"team-a": "sk-team-a-0123456789", "team-b": "sk-team-b-0123456789"}
    kube("create", "secret", "generic", "tally-api-keys",
         "--from-literal=api-keys=" + "".join(f"{tenant} {key}\n" for tenant, key in keys.items()))
    manifest = service(replicas=2)
    manifest["spec"]["auth"] = {"apiKeysSecret": {"name": "tally-api-keys"}}
    kube.apply(manifest)
    pods = serving_pods(kube, 2)
    sent = [complete(ip(p), stream=i % 2 == 0, tenant=tenant, key=keys[tenant])
            for i, p in enumerate(pods) for tenant in keys]
    exact(kube, sent, "with two tenants on two pods")

    killed = operator.kill()
    victim = pods[0]
    sent += [complete(ip(victim), stream=True, tenant=tenant, key=keys[tenant]) for tenant in keys]
    operator.restarted(killed)  # at once: a restarted operator does not wait out its own peering entry
    for pod in operator.pods():  # and then away (paused, as a node under pressure would hold them)
        node_ctr(kube.env, "tasks", "pause", container_id(pod))
        frozen.append((kube.env, container_id(pod)))
    kube("delete", "pod", victim["metadata"]["name"], "--wait=false")
    metrics_url = f"http://{ip(victim)}:8001"

    def drained() -> str:
        with in_cluster(5) as http:
            text = http.get(f"{metrics_url}/metrics").text
        return text if "\ntally_draining 1.0" in text and "\ntally_inflight_generations 0.0" in text else ""

    final = eventually(drained, 60, interval=0.5, what="the deleted pod drained")
    counters = {"podUid": victim["metadata"]["uid"], "epoch": metric(final, "tally_start_time_seconds"),
                "requests": metric(final, "tally_requests_total"),
                "promptTokens": metric(final, "tally_prompt_tokens_total"),
                "completionTokens": metric(final, "tally_completion_tokens_total"),
                "cachedTokens": metric(final, "tally_cached_tokens_total")}
    with in_cluster(5) as http:  # the test's relay is another pod of the cluster network
        forged = http.post(f"{metrics_url}/internal/final-read", json=counters)
        signed_badly = http.post(f"{metrics_url}/internal/final-read", json=counters,
                                 headers={"X-Tally-Signature": "A" * 88})
        released = http.post(f"{metrics_url}/internal/final-read",
                             json={"podUid": victim["metadata"]["uid"], "release": True})
        assert [forged.status_code, signed_badly.status_code, released.status_code] == [403, 403, 403]
        assert http.get(f"{metrics_url}/metrics").status_code == 200  # still there, still waiting

    while frozen:  # within the operators' liveness budget
        node_ctr(kube.env, "tasks", "resume", frozen.pop()[1])
    usage = exact(kube, sent, "after a pod was deleted while every operator was down", deadline=240)
    assert usage["podsUnaccounted"] == 0
    # the pod's counters may be exact before its final read (it served nothing after its last scrape): the
    # signed acknowledgement then lets it exit, and it leaves the ledger accounted for
    eventually(lambda: all(u["uid"] != victim["metadata"]["uid"] for u in status(kube)["usage"]["pods"]), 60,
               interval=1, what="the deleted pod acknowledged, gone and out of the ledger")
    assert status(kube)["usage"]["podsUnaccounted"] == 0
    ledger = {name: t["completionTokens"] for name, t in usage["tenants"].items()}
    eventually(lambda: any(tenant_series(text, str(kube.namespace)) == ledger for text in operator.metrics()), 30,
               interval=1,
               what=f"the restarted operator's tenant series equal to the ledger's {ledger}")


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (every label set)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def test_deleting_a_service_releases_its_pods_from_a_final_read_nobody_will_book(
        operator: ChartOperator, kube: Kubectl) -> None:
    """With its CompletionService gone there is no ledger to book a final read into: the operator makes the pods
    drain at once (deleting their Deployment) and releases each with a signed message naming its drain's nonce,
    so they exit in seconds rather than waiting out their final-read budget (minutes)."""
    kube.apply(service(replicas=2))
    pods = serving_pods(kube, 2)
    kube("delete", "completionservice", "smollm", "--wait=false")
    names = {p["metadata"]["name"] for p in pods}
    eventually(lambda: not names & {p["metadata"]["name"] for p in kube.json("get", "pods")["items"]}, 90,
               interval=1, what="the deleted service's pods released and gone")
