"""End-to-end usage helpers: the CPU example as a service on the real node, what its clients were billed."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import yaml
from kube_harness import ROOT, Kubectl, eventually, in_cluster

MODEL = "smollm2-135m-instruct"


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


def live_pods(kube: Kubectl) -> list[dict[str, Any]]:
    """Pods that run: with an IP, not being deleted, not terminal (an evicted pod keeps its IP)."""
    return [p for p in kube.json("get", "pods")["items"] if p["status"].get("podIP")
            and not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in {"Failed", "Succeeded"}]


def serving_pods(kube: Kubectl, count: int, deadline: float = 180) -> list[dict[str, Any]]:
    """Exactly `count` live pods, each with a runtime answering /health on its pod IP."""
    def ready() -> list[dict[str, Any]]:
        pods = live_pods(kube)
        serving = [p for p in pods if healthy(p["status"]["podIP"])]
        return serving if len(serving) == count == len(pods) else []

    return list(eventually(ready, deadline, interval=0.5, what=f"{count} runtimes serving on pod IPs"))


def healthy(ip: str) -> bool:
    try:
        with in_cluster(2) as http:
            return http.get(f"http://{ip}:8000/health").status_code == 200
    except httpx.HTTPError:
        return False


def complete(ip: str, stream: bool, prompt: str = "Tell me a joke", max_tokens: int = 6,
             tenant: str | None = None) -> dict[str, int]:
    """One completion from the openai SDK (inside the cluster, through its relay); the usage it was told."""
    with in_cluster(120) as http:
        client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", max_retries=0, http_client=http,
                               default_headers={"X-Tally-Tenant": tenant} if tenant else None)
        if not stream:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
            assert reply.usage is not None
            return {"prompt": reply.usage.prompt_tokens, "completion": reply.usage.completion_tokens}
        usage = None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            usage = chunk.usage or usage
    assert usage is not None
    return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens}


def totals_match(kube: Kubectl, sent: list[dict[str, int]]) -> dict[str, Any]:
    usage = status(kube).get("usage") or {}
    expected = (len(sent), sum(u["prompt"] for u in sent), sum(u["completion"] for u in sent))
    return usage if (usage.get("requests"), usage.get("promptTokens"), usage.get("completionTokens")) == expected \
        else {}


class ClientThreads:
    """Clients in threads of their own (`client(i)`), calling until stopped: what they received (usage) and
    what failed. A context manager: started on entry, stopped and joined on exit."""

    def __init__(self, clients: int) -> None:
        self.stop = threading.Event()
        self.received: list[dict[str, int]] = []
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]

    def client(self, i: int) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)

    def served(self) -> int:
        with self.lock:
            return len(self.received)
