"""The InferencePool backend on the real node, the operator's side: a CompletionService routed through an
InferencePool while the CRD is missing says so and keeps serving; once the Gateway API Inference Extension's
CRD (v1.5.0) is installed the operator creates the pool of the service's pods and the endpoint picker's
objects (its RoleBinding accepted by RBAC and the reach policy), the pods carry the engine-type labels and
serve the picker's gauges on the API port and nothing of Tally's, the picker becomes ready; routing switched
off removes them.

Then the picker itself (the extension's EPP v1.5.0, built by `make images`) behind a test gateway
(tests/gateway: the gateway's side of ext_proc, in Go): with one pod held busy by long streams, new short
requests go to the other; a pod that drains gets none; every stream completes; and the picker's own token
counters equal Tally's ledger for the requests that went through it, streamed or not.

And a routed service that scales to zero: at zero its pool selects the activators, so the picker's requests are
held and wake it, and the ledger equals what those clients were told through 0 -> 1 -> 0."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from kube_harness import ROOT, Kubectl, eventually, in_cluster
from operator_harness import ChartOperator
from runtime_harness import free_port, sse_payloads, terminate
from usage_harness import MODEL, healthy, ledger_tenants, service, status

pytestmark = pytest.mark.e2e

CRD = Path(__file__).parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
CRD_NAME = "inferencepools.inference.networking.k8s.io"
OBJECTIVES = Path(__file__).parent / "crds" / "inference.networking.x-k8s.io_inferenceobjectives.yaml"
OBJECTIVES_NAME = "inferenceobjectives.inference.networking.x-k8s.io"
FAIRNESS = "x-gateway-inference-fairness-id"


@pytest.fixture
def no_pool_crd(kubectl: Kubectl) -> Iterator[Kubectl]:
    """The cluster without the InferencePool CRD; removed again afterwards (other tests expect none)."""
    kubectl("delete", "crd", CRD_NAME, OBJECTIVES_NAME, "--ignore-not-found", "--wait=true")
    yield kubectl
    kubectl("delete", "crd", CRD_NAME, OBJECTIVES_NAME, "--ignore-not-found", "--wait=false")


RUNTIME = "serving.tally.dev/completionservice=smollm"


def runtime_pods(kube: Kubectl, count: int) -> list[dict[str, Any]]:
    """Exactly `count` runtime pods ready and answering on their pod IPs (the picker's pod aside)."""
    def ready() -> list[dict[str, Any]]:
        pods = [p for p in kube.json("get", "pods", "-l", RUNTIME)["items"]
                if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")]
        serving = [p for p in pods if healthy(p["status"]["podIP"])]
        return serving if len(serving) == count == len(pods) else []

    return list(eventually(ready, 180, interval=0.5, what=f"{count} runtimes serving"))


def condition(kube: Kubectl) -> dict[str, Any]:
    return next((c for c in status(kube).get("conditions") or [] if c["type"] == "InferencePoolReady"), {})


def names(kube: Kubectl, kinds: str) -> set[str]:
    return set(kube("get", kinds, "-o", "jsonpath={.items[*].metadata.name}").split())


def test_a_routed_service_gets_its_pool_and_picker_once_the_crd_is_installed(
        operator: ChartOperator, kube: Kubectl, no_pool_crd: Kubectl) -> None:
    manifest = service(replicas=1)
    manifest["spec"]["routing"] = {"inferencePool": {"enabled": True}}
    kube.apply(manifest)
    eventually(lambda: condition(kube).get("reason") == "CRDNotInstalled", 120, interval=1,
               what="InferencePoolReady=False, CRDNotInstalled")
    (pod,) = runtime_pods(kube, 1)  # the service serves meanwhile
    labels = pod["metadata"]["labels"]
    assert labels["inference.networking.k8s.io/engine-type"] == labels["llm-d.ai/engine-type"] == "sglang"
    with in_cluster(10) as http:
        page = http.get(f"http://{pod['status']['podIP']}:8000/metrics").text
    assert "sglang:num_queue_reqs" in page and "sglang:cache_config_info" in page
    assert "tally_" not in page and "tenant" not in page

    no_pool_crd("apply", "--server-side", "-f", str(CRD))
    no_pool_crd("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    pool = eventually(lambda: kube.json("get", "inferencepool", "smollm"), 90, interval=1,
                      what="the InferencePool (discovery looks again within 30 s)")
    assert pool["spec"]["selector"] == {"matchLabels": {"serving.tally.dev/completionservice": "smollm"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "smollm-epp"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "CompletionService"
    eventually(lambda: {"smollm-epp"} <= names(kube, "serviceaccounts") & names(kube, "rolebindings")
               & names(kube, "deployments") & names(kube, "services"), 60, interval=1,
               what="the picker's ServiceAccount, RoleBinding, Deployment and Service")
    binding = kube.json("get", "rolebinding", "smollm-epp")
    assert binding["roleRef"]["name"] == "tally-operator-epp"
    eventually(lambda: condition(kube).get("reason") == "AsExpected", 120, interval=1,
               what="InferencePoolReady=True once the picker runs")
    routing = status(kube).get("routing") or {}
    assert routing == {"inferencePool": "smollm", "endpointPicker": "smollm-epp", "pickerReady": True}

    kube("patch", "completionservice", "smollm", "--type=merge", "-p",
         '{"spec":{"routing":{"inferencePool":{"enabled":false}}}}')
    eventually(lambda: not names(kube, "inferencepools") and "smollm-epp" not in names(kube, "deployments")
               | names(kube, "services") | names(kube, "serviceaccounts") | names(kube, "rolebindings"), 90,
               interval=1, what="the pool and the picker removed once routing is off")


GATEWAY_SOURCE = ROOT / "tests" / "gateway"
CACHE = Path(os.environ.get("TALLY_CACHE", Path.home() / ".cache" / "tally"))


@pytest.fixture(scope="session")
def gateway_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/gateway built with Go (its modules from the proxy, cached like the control plane's)."""
    out = tmp_path_factory.mktemp("gateway") / "gateway"
    env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-modcacherw",
           "GOMODCACHE": str(CACHE / "gomod"), "GOCACHE": str(CACHE / "gobuild")}
    subprocess.run(["go", "build", "-o", str(out), "."], cwd=GATEWAY_SOURCE, env=env, check=True, timeout=600)
    return out


@contextmanager
def gateway_process(binary: Path, picker: str, proxy: str, log: Path) -> Iterator[str]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([str(binary), "-listen", f"127.0.0.1:{port}", "-picker", picker, "-proxy", proxy],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                assert proc.poll() is None, log.read_text()  # it exited: fail at once, with its words
                return False

        eventually(listening, 30, what="the test gateway listening")
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate(proc)


def picker_lines(kube: Kubectl) -> list[str]:
    """The picker's own /metrics, its samples' lines (none while its ClusterIP does not take connections yet:
    kube-proxy programs it a little after the picker turns ready, and the callers poll)."""
    ip = kube.json("get", "service", "smollm-epp")["spec"]["clusterIP"]
    try:
        with in_cluster(10) as http:
            text = http.get(f"http://{ip}:9090/metrics").text
    except httpx.TransportError:
        return []
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def picker_metrics(kube: Kubectl) -> dict[str, float]:
    """The picker's own series, summed over their labels."""
    sums: dict[str, float] = {}
    for line in picker_lines(kube):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def picker_tokens(kube: Kubectl) -> tuple[float, float]:
    """The picker's own counters: input and output tokens it read from the responses (histogram sums)."""
    sums = picker_metrics(kube)
    return sums.get("inference_objective_input_tokens_sum", 0.0), sums.get("inference_objective_output_tokens_sum", 0.0)


def test_the_picker_sends_new_requests_away_from_a_busy_pod_and_counts_what_tallys_ledger_counts(
        operator: ChartOperator, kube: Kubectl, no_pool_crd: Kubectl, gateway_binary: Path, tmp_path: Path) -> None:
    for crd, name in ((CRD, CRD_NAME), (OBJECTIVES, OBJECTIVES_NAME)):
        no_pool_crd("apply", "--server-side", "-f", str(crd))
        no_pool_crd("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    manifest = service(replicas=2)
    manifest["spec"]["engine"]["maxConcurrentGenerations"] = 1  # a long stream makes a pod busy, more queue
    manifest["spec"]["routing"] = {"inferencePool": {"enabled": True}}
    manifest["spec"]["auth"] = {"tenantHeader": FAIRNESS}  # the gateway's fairness id is the tenant
    manifest["spec"]["drainSeconds"] = 120
    kube.apply(manifest)
    # A service tier is an InferenceObjective of the pool: its priority is the picker's, per request
    kube.apply({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
                "metadata": {"name": "premium"}, "spec": {"poolRef": {"name": "smollm"}, "priority": 10}})
    pods = runtime_pods(kube, 2)
    eventually(lambda: condition(kube).get("reason") == "AsExpected", 180, interval=1, what="the picker ready")
    eventually(lambda: picker_metrics(kube).get("inference_pool_ready_pods") == 2, 120, interval=1,
               what="the picker knows both pods")
    busy, idle = pods[0]["status"]["podIP"], pods[1]["status"]["podIP"]
    picker = kube.json("get", "service", "smollm-epp")["spec"]["clusterIP"] + ":9002"
    long_done: list[dict[str, Any]] = []

    def long_stream(i: int) -> None:  # straight to the busy pod, as its own tenant
        with in_cluster(300) as http, http.stream("POST", f"http://{busy}:8000/v1/completions", headers={
                FAIRNESS: "busy"}, json={"model": MODEL, "prompt": f"Long story {i}:", "max_tokens": 300,
                                                  "ignore_eos": True, "stream": True}) as response:
            body = b"".join(response.iter_raw())
        long_done.append({"status": response.status_code, "done": body.rstrip().endswith(b"data: [DONE]")})

    holders = [threading.Thread(target=long_stream, args=(i,)) for i in range(3)]
    for holder in holders:
        holder.start()
    with gateway_process(gateway_binary, picker, kube.env["TALLY_PROXY"], tmp_path / "gateway.log") as url:
        def queued_on_busy() -> bool:
            with in_cluster(5) as http:
                page = http.get(f"http://{busy}:8000/metrics").text
            return f'sglang:num_queue_reqs{{model_name="{MODEL}"}} 2.0' in page
        eventually(queued_on_busy, 60, interval=0.5, what="the busy pod running one stream with two queued")
        picked: list[str] = []
        sent = 0
        for i in range(20):
            body = {"model": MODEL, "prompt": f"Short {i}:", "max_tokens": 4, "stream": i % 2 == 0}
            headers = {FAIRNESS: "via-gateway"} | ({"x-gateway-inference-objective": "premium"} if i < 5 else {})
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120, headers=headers)
            assert response.status_code == 200, response.text
            sent += 1
            picked.append(response.headers["x-test-picked-endpoint"].rsplit(":", 1)[0])
        to_idle = sum(1 for ip in picked if ip == idle)
        print(f"\n[inference-pool] {to_idle} of {len(picked)} short requests went to the idle pod")
        assert to_idle >= 18, picked  # at least 90 %
        # The busy pod drains (its streams still run): the picker sends it nothing more
        kube("delete", "pod", pods[0]["metadata"]["name"], "--wait=false")
        eventually(lambda: kube.json("get", "pod", pods[0]["metadata"]["name"])["metadata"].get("deletionTimestamp"),
                   30, interval=0.25, what="the busy pod terminating (the picker drops such a pod)")
        during: list[str] = []
        for i in range(10):
            response = httpx.post(f"{url}/v1/completions", timeout=120, headers={FAIRNESS: "via-gateway"},
                                  json={"model": MODEL, "prompt": f"Later {i}:", "max_tokens": 4, "stream": i % 2 == 1})
            assert response.status_code == 200, response.text
            sent += 1
            during.append(response.headers["x-test-picked-endpoint"].rsplit(":", 1)[0])
        assert busy not in during, during
        for holder in holders:
            holder.join(timeout=300)
        assert long_done == [{"status": 200, "done": True}] * 3  # every stream completes, drained or not

        def same_books() -> bool:
            ledger = ledger_tenants(status(kube).get("usage") or {})
            through = ledger.get("via-gateway")
            return through is not None and through[0] == sent and picker_tokens(kube) == (through[1], through[2])
        eventually(same_books, 120, interval=1, what="the picker's token counters equal Tally's ledger for them")
        premium = sum(float(line.rsplit(" ", 1)[1]) for line in picker_lines(kube)
                      if line.startswith("inference_objective_request_total{") and 'priority="10"' in line)
        assert premium == 5  # the tier's requests, at its priority; billed to their tenant like the rest


ACTIVATOR = "serving.tally.dev/activator-for"


def pool_selector(kube: Kubectl) -> dict[str, str]:
    return dict(kube.json("get", "inferencepool", "smollm")["spec"]["selector"]["matchLabels"])


def billed_usage(response: httpx.Response) -> tuple[int, int]:
    """(prompt, completion) tokens the client was told: a JSON body's usage, or a stream's usage chunk."""
    if response.headers["content-type"].startswith("application/json"):
        usage = response.json()["usage"]
    else:
        usage = next(c["usage"] for c in reversed(sse_payloads(response.content)) if c != "[DONE]" and c["usage"])
    return usage["prompt_tokens"], usage["completion_tokens"]


def test_a_routed_service_at_zero_is_woken_through_the_picker_and_billed_as_its_clients_were_told(
        operator: ChartOperator, kube: Kubectl, no_pool_crd: Kubectl, gateway_binary: Path, tmp_path: Path) -> None:
    """Scale to zero behind the picker: at zero the pool selects the activator's pods (as the Service does), so
    the picker picks one and the request is held there, not refused; the picker's scrapes of the activators
    never wake the service; the held requests start a pod and are answered through the activator; once the pod
    is ready the pool selects it and the picker sends new requests straight to it; after the grace the pool is
    back on the activators. What the clients were told equals the ledger through 0 -> 1 -> 0."""
    no_pool_crd("apply", "--server-side", "-f", str(CRD))
    no_pool_crd("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    manifest = service(replicas=1)
    manifest["spec"]["routing"] = {"inferencePool": {"enabled": True}}
    manifest["spec"]["auth"] = {"tenantHeader": FAIRNESS}
    manifest["spec"]["autoscaling"] = {
        "minReplicas": 0, "maxReplicas": 1, "metric": "queuedRequests", "target": 4, "stableWindowSeconds": 10,
        "panicWindowSeconds": 4, "scaleDownDelaySeconds": 10,
        "scaleToZero": {"graceSeconds": 20, "holdSeconds": 240, "maxHeldRequests": 32, "activatorReplicas": 2}}
    kube.apply(manifest)
    at_zero = {ACTIVATOR: "smollm"}

    def resting() -> bool:
        return (not kube.json("get", "pods", "-l", RUNTIME)["items"] and pool_selector(kube) == at_zero
                and condition(kube).get("reason") == "AsExpected"
                and picker_metrics(kube).get("inference_pool_ready_pods") == 2)

    eventually(resting, 240, interval=1, what="no runtime pod, the pool on the two activators, the picker ready")
    activators = {p["status"]["podIP"] for p in kube.json("get", "pods", "-l", f"{ACTIVATOR}=smollm")["items"]}
    # The picker scrapes the activators many times a second: for 6 s of it nothing is held or counted there,
    # and no pod is asked for (an absence, so watched for a while rather than waited for)
    watch_until = time.monotonic() + 6
    while time.monotonic() < watch_until:
        with in_cluster(10) as http:
            pages = [http.get(f"http://{ip}:8001/metrics").text for ip in activators]
        assert all("tally_activator_held_requests 0.0" in page and "tally_activator_requests_total{" not in page
                   for page in pages), pages
        assert (status(kube).get("autoscaling") or {}).get("desiredReplicas", 0) == 0
        assert not kube.json("get", "pods", "-l", RUNTIME)["items"]
        time.sleep(0.5)
    picker = kube.json("get", "service", "smollm-epp")["spec"]["clusterIP"] + ":9002"
    told: list[tuple[int, int]] = []
    picked: list[str] = []
    failures: list[str] = []
    lock = threading.Lock()

    def ask(url: str, i: int) -> None:
        body = {"model": MODEL, "prompt": f"Wake {i}:", "max_tokens": 6, "stream": i % 2 == 0}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=300, headers={FAIRNESS: "woken"})
        took.append(time.monotonic() - began)
        with lock:
            if response.status_code != 200:
                failures.append(f"{response.status_code} {response.text[:300]}")
                return
            told.append(billed_usage(response))
            picked.append(response.headers["x-test-picked-endpoint"].rsplit(":", 1)[0])

    took: list[float] = []
    with gateway_process(gateway_binary, picker, kube.env["TALLY_PROXY"], tmp_path / "gateway.log") as url:
        began = time.monotonic()
        clients = [threading.Thread(target=ask, args=(url, i)) for i in range(4)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=300)
        assert not failures, failures
        assert len(told) == 4 and set(picked) <= activators, (picked, activators)
        print(f"\n[inference-pool] from zero through the picker: 4 of 4 answered, in {min(took):.1f} to "
              f"{max(took):.1f} s (whole responses)")
        (pod,) = runtime_pods(kube, 1)
        eventually(lambda: pool_selector(kube) == {"serving.tally.dev/completionservice": "smollm"}, 60,
                   interval=1, what="the pool on the pod once it is ready")
        eventually(lambda: picker_metrics(kube).get("inference_pool_ready_pods") == 1, 60, interval=1,
                   what="the picker knows the pod alone")
        ask(url, 5)  # straight to the pod now
        assert not failures and picked[-1] == pod["status"]["podIP"], (failures, picked)
        reasons = kube("get", "events", "-o", "jsonpath={.items[*].message}")
        assert "The Service and the InferencePool now point at its pods" in reasons, reasons
    eventually(resting, 240, interval=1, what="back to zero after the grace, the pool on the activators")

    def same_books() -> bool:
        ledger = ledger_tenants(status(kube).get("usage") or {})
        return ledger.get("woken") == (len(told), sum(p for p, _ in told), sum(c for _, c in told))
    eventually(same_books, 90, interval=1, what="the ledger equal to what the clients were told")
