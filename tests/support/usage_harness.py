"""End-to-end usage helpers: the CPU example as a service on the real node, what its clients were billed."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import yaml
from kube_harness import ROOT, Kubectl, eventually, in_cluster

from tally_operator.report import BUDGET_FIELDS, FIELDS, budget_rows, rows
from tally_operator.shard_store import with_shard_budgets

MODEL = "smollm2-135m-instruct"


def service(name: str = "smollm", replicas: int = 2) -> dict[str, Any]:
    manifest = yaml.safe_load((ROOT / "crds" / "examples" / "smollm-cpu.yaml").read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["replicas"] = replicas
    manifest["spec"]["usageHealth"] = {"scrapeIntervalSeconds": 1}
    return dict(manifest)


def status(kube: Kubectl, name: str = "smollm") -> dict[str, Any]:
    """The service's status, with its tenants read from its UsageShards as `tally-usage` reads them (in
    `usage.tenants` and `budgets`, where the status kept them before the shards)."""
    obj = kube.json("get", "completionservice", name)
    found = dict(obj.get("status") or {})
    usage = found.get("usage") or {}
    if "shardKey" in usage:
        shards = kube.json("get", "usageshards", "-l", f"serving.tally.dev/service-uid={obj['metadata']['uid']}")
        lines = rows({"kind": "List", "items": [obj, *shards["items"]]})
        found["usage"] = {**usage, "tenants": {r.tenant: dict(zip(FIELDS, r.counts, strict=True)) for r in lines}}
        found = with_shard_budgets({**obj, "status": found}, shards["items"])["status"]
    return found


def budget_month(kubectl: Kubectl, budget: str, tenant: str) -> dict[str, int]:
    """A tenant's month under a platform Budget, as `kubectl get budgets,budgetshards -o json | tally-usage`
    reads it (its tenants are in the Budget's BudgetShards): budget, spent, held, remaining; {} if none yet."""
    document = json.loads(kubectl("get", "budgets,budgetshards", "-o", "json"))
    return next((dict(zip(BUDGET_FIELDS, row.counts, strict=True)) for row in budget_rows(document)
                 if row.budget == budget and row.tenant == tenant), {})


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
             tenant: str | None = None, key: str | None = None) -> dict[str, Any]:
    """One completion from the openai SDK (inside the cluster, through its relay); the usage it was told and
    the tenant it is billed to (`tenant`: with `key`, the key's tenant; without, named by header)."""
    with in_cluster(120) as http:
        client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key=key or "unused", max_retries=0,
                               http_client=http,
                               default_headers={"X-Tally-Tenant": tenant} if tenant and not key else None)
        if not stream:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
            assert reply.usage is not None
            return {"prompt": reply.usage.prompt_tokens, "completion": reply.usage.completion_tokens,
                    "tenant": tenant or "anonymous"}
        usage = None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            usage = chunk.usage or usage
    assert usage is not None
    return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens, "tenant": tenant or "anonymous"}


def billed(sent: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """What each tenant's clients were told: (requests, prompt tokens, completion tokens)."""
    tenants: dict[str, tuple[int, int, int]] = {}
    for usage in sent:
        requests, prompt, completion = tenants.get(usage.get("tenant", "anonymous"), (0, 0, 0))
        tenants[usage.get("tenant", "anonymous")] = (requests + 1, prompt + usage["prompt"],
                                                     completion + usage["completion"])
    return tenants


def ledger_tenants(usage: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    return {name: (t.get("requests"), t.get("promptTokens"), t.get("completionTokens"))
            for name, t in (usage.get("tenants") or {}).items()}


def totals_match(kube: Kubectl, sent: list[dict[str, Any]], name: str = "smollm") -> dict[str, Any]:
    """status.usage when its totals and every tenant's equal what the clients were told, else {}."""
    usage = status(kube, name).get("usage") or {}
    expected = (len(sent), sum(u["prompt"] for u in sent), sum(u["completion"] for u in sent))
    totals = (usage.get("requests"), usage.get("promptTokens"), usage.get("completionTokens"))
    return usage if totals == expected and ledger_tenants(usage) == billed(sent) else {}


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


class SdkClients:
    """`openai` SDK clients of one API key with their default retries (max_retries=2), each attempt counted as
    it is sent: completions of `max_tokens` with `ignore_eos` (each bills its prompt and exactly that)."""

    def __init__(self, key: str, max_tokens: int = 24) -> None:
        self.key, self.max_tokens = key, max_tokens
        self.attempts = 0
        self.lock = threading.Lock()

    def count(self, _: Any) -> None:
        with self.lock:
            self.attempts += 1

    def call(self, ip: str) -> tuple[str, int, str]:
        """(where, tokens billed, "" or the status and error code)."""
        with in_cluster(180) as http:
            http.event_hooks["request"].append(self.count)
            sdk = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key=self.key, http_client=http, timeout=180)
            try:
                reply = sdk.completions.create(model=MODEL, prompt="Tell me a joke", max_tokens=self.max_tokens,
                                               extra_body={"ignore_eos": True})
            except openai.APIStatusError as error:
                body = error.body if isinstance(error.body, dict) else {}
                return ip, 0, f"{error.status_code} {body.get('code') or body.get('type') or error.message}"
            assert reply.usage is not None
            return ip, reply.usage.total_tokens, ""
