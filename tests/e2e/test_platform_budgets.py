"""A platform Budget on the real node: one tenant's month across two services (two models' worth of pods), spent
by `openai` SDK clients with their default retries. The review found that with the SDK's defaults none of 100
requests was served (a pod leased a tenant only after serving it; refusals were `rate_limit_exceeded`, which the
SDK retries three times a second apart); now a request that fits what the tenant has left waits for allowance,
the operator grants it between its rounds (the pod asks; its service asks its Budget for a larger slice), and a
request that does not fit is refused `insufficient_quota`, which the SDK does not retry.

Checked: spend never above the budget, at least 95 % of it spent, every refusal `insufficient_quota`, attempts at
most 1.1 x requests, and the Budget's books and each service's ledger equal to what the clients were told."""

from __future__ import annotations

import concurrent.futures
import secrets
import threading
from typing import Any

import openai
import pytest
from kube_harness import Kubectl, eventually, in_cluster
from operator_harness import ChartOperator
from usage_harness import MODEL, budget_month, service, serving_pods, status

pytestmark = pytest.mark.e2e
BUDGET = 2_000
REQUESTS = 100
MAX_TOKENS = 24  # with ignore_eos every request bills its prompt and exactly this: its reservation (100 of
# them ask for about 2,800 tokens, more than the budget)


class Clients:
    """SDK clients with their default retries (max_retries=2), each attempt counted as it is sent."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.attempts = 0
        self.lock = threading.Lock()

    def count(self, _: Any) -> None:
        with self.lock:
            self.attempts += 1

    def call(self, ip: str) -> tuple[str, int, str]:
        """(where, tokens billed, "" or the error code)."""
        with in_cluster(180) as http:
            http.event_hooks["request"].append(self.count)
            sdk = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key=self.key, http_client=http, timeout=180)
            try:
                reply = sdk.completions.create(model=MODEL, prompt="Tell me a joke", max_tokens=MAX_TOKENS,
                                               extra_body={"ignore_eos": True})
            except openai.APIStatusError as error:
                body = error.body if isinstance(error.body, dict) else {}
                return ip, 0, f"{error.status_code} {body.get('code') or body.get('type') or error.message}"
            assert reply.usage is not None
            return ip, reply.usage.total_tokens, ""


def test_a_platform_budget_over_two_services_is_spent_to_within_5_percent_and_never_past_it(
        operator: ChartOperator, kubectl: Kubectl, kube: Kubectl, namespace: str) -> None:
    key = secrets.token_hex(16)
    kube("create", "secret", "generic", "tally-api-keys", f"--from-literal=api-keys=acme {key}\n")
    names = ("chat", "code")
    budget_name = f"{namespace}-acme"  # first: a Budget that comes to cover running services rolls their pods once
    kubectl.apply({"apiVersion": "serving.tally.dev/v1alpha1", "kind": "Budget", "metadata": {"name": budget_name},
                   "spec": {"services": {"namespaces": [namespace]},
                            "tenants": [{"name": "acme", "monthly": BUDGET}]}})
    try:
        for name in names:
            manifest = service(name, replicas=1)
            manifest["spec"]["auth"] = {"apiKeysSecret": {"name": "tally-api-keys"}}
            kube.apply(manifest)
        pods = serving_pods(kube, 2)
        by_ip = {p["status"]["podIP"]: p["metadata"]["labels"]["serving.tally.dev/completionservice"] for p in pods}
        assert sorted(by_ip.values()) == sorted(names)
        clients = Clients(key)
        ips = sorted(by_ip)
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            answers = list(pool.map(clients.call, [ips[i % 2] for i in range(REQUESTS)]))
        spent = sum(tokens for _, tokens, _ in answers)
        refused = [error for _, _, error in answers if error]
        assert spent <= BUDGET, spent
        assert spent >= 0.95 * BUDGET, (spent, refused[:5])
        assert refused and set(refused) == {"429 insufficient_quota"}, sorted(set(refused))
        assert clients.attempts <= 1.1 * REQUESTS, clients.attempts

        def booked() -> dict[str, Any]:
            view = budget_month(kubectl, budget_name, "acme")
            return view if view and view.get("spent") == spent else {}

        view = eventually(booked, 90, interval=1, what=f"the Budget's books at the clients' {spent} tokens")
        assert view["budget"] == BUDGET and view["spent"] + view["held"] + view["remaining"] == BUDGET
        kept = kubectl.json("get", "budget", budget_name)["status"]  # the tenant's month is in a BudgetShard
        assert "tenants" not in kept and kept["tenantCount"] == 1 and len(kept["shardSeqs"]) == 1
        for name in names:  # each service's ledger: what its clients were told
            told = sum(tokens for ip, tokens, _ in answers if by_ip[ip] == name)
            assert told > 0, name

            def ledger(name: str = name, told: int = told) -> bool:
                acme = ((status(kube, name).get("usage") or {}).get("tenants") or {}).get("acme") or {}
                return acme.get("promptTokens", 0) + acme.get("completionTokens", 0) == told

            eventually(ledger, 60, interval=1, what=f"{name}'s ledger at its clients' {told} tokens")
        applied = next(c for c in status(kube, names[0])["conditions"] if c["type"] == "BudgetApplied")
        assert (applied["status"], applied["reason"]) == ("True", "PlatformBudget")
    finally:
        kubectl("delete", "budget", budget_name, "--wait=false", check=False)


def test_a_serving_namespaces_edit_role_cannot_write_a_budget(operator: ChartOperator, kube: Kubectl,
                                                              namespace: str) -> None:
    """Budgets were in the serving team's own spec, so namespace `edit` could raise them. A Budget is
    cluster-scoped and no aggregated role grants it: the API server's RBAC says so for a user bound to `edit`
    (and to `admin`) in the namespace, who may still write CompletionServices."""
    user = f"system:serviceaccount:{namespace}:team"
    for role in ("edit", "admin"):
        kube("create", "rolebinding", f"team-{role}", f"--clusterrole={role}", f"--serviceaccount={namespace}:team")

    def can(verb: str, resource: str) -> str:
        return kube("auth", "can-i", verb, resource, f"--as={user}", check=False).strip()

    eventually(lambda: can("create", "completionservices.serving.tally.dev") == "yes", 30, interval=0.5,
               what="the aggregated roles in force")
    for verb in ("create", "update", "patch", "delete"):
        assert can(verb, "budgets.serving.tally.dev") == "no", verb
    assert can("update", "budgets.serving.tally.dev/status") == "no"
