"""Operator scale on the local control plane, against the API server's own ceiling in the same run.

1. ceiling: a plain client applies the Deployments and Services the operator would build for N services
   (the same builders), and we wait until every Deployment is Available (kcm + scheduler + kwok).
2. operator: N CompletionServices; we wait until every one reports Ready=True, and sample the operator
   process's CPU time and peak memory.
3. one scrape round over P pods' /metrics (real runtime metrics text, served on loopback) with the
   operator's scrape + parse code.
4. with --tenants T: the books of one service of P pods whose tenants are T in all (each pod serving up to
   the per-pod bound): a pod's /metrics size and parse time, one round booked and planned with a default
   budget, the status it writes (bytes: etcd refuses objects over about 1.5 MiB) and the memory it takes.

    python benchmarks/operator_scale.py [--services 200] [--pods 500] [--tenants 1000] [--json out.json]
(brings the local control plane up if needed; leaves it up)
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from kube_harness import Kubectl, cluster_env  # noqa: E402

from tally_operator.desired import desired_deployment, desired_service  # noqa: E402
from tally_operator.samples import parse_sample  # noqa: E402
from tally_operator.scrape import scrape  # noqa: E402
from tally_operator.settings import OperatorSettings  # noqa: E402
from tally_operator.spec import parse_spec  # noqa: E402

SPEC = {"model": {"name": "m"}, "engine": {"kind": "cpu"}, "replicas": 1,
        "resources": {"gpus": 0, "cpu": "100m", "memory": "64Mi"},
        "scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "usageHealth": {"scrapeIntervalSeconds": 60}}


def wait(predicate: Any, deadline: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < deadline:
        if predicate():
            return time.perf_counter() - start
        time.sleep(0.5)
    raise TimeoutError("not reached")


def apply_all(kubectl: Kubectl, namespace: str, objects: list[dict[str, Any]]) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                     "items": objects}))


def ceiling(kubectl: Kubectl, n: int) -> float:
    ns = "bench-ceiling"
    kubectl("create", "namespace", ns, check=False)
    spec = parse_spec(SPEC)
    objects: list[dict[str, Any]] = []
    for i in range(n):
        meta = {"name": f"svc-{i}", "namespace": ns, "uid": "00000000-0000-0000-0000-000000000000"}
        dep, svc = desired_deployment(meta, spec, OperatorSettings()), desired_service(meta)
        for obj in (dep, svc):
            obj["metadata"].pop("ownerReferences")
        objects += [dep, svc]
    start = time.perf_counter()
    apply_all(kubectl, ns, objects)

    def available() -> bool:
        items = kubectl.json("get", "deployments", "-n", ns)["items"]
        return len(items) == n and all((d.get("status") or {}).get("availableReplicas") == 1 for d in items)

    wait(available, 900)
    return time.perf_counter() - start


def operator_run(kubectl: Kubectl, env: dict[str, str], n: int) -> dict[str, float]:
    ns = "bench-operator"
    kubectl("apply", "-f", str(ROOT / "crds"))
    kubectl("create", "namespace", ns, check=False)
    log = open(ROOT / ".tally" / "bench-operator.log", "wb")  # noqa: SIM115
    profile = os.environ.get("TALLY_BENCH_PROFILE")  # a py-spy binary: record the operator (not timed)
    wrapper = [profile, "record", "-r", "50", "-f", "raw", "-o", str(ROOT / ".tally" / "operator.prof"), "--"] \
        if profile else []
    proc = subprocess.Popen([*wrapper, sys.executable, "-m", "tally_operator", "--standalone", "--log-level=WARNING",
                             "--liveness=http://127.0.0.1:18099/healthz"], stdout=log, stderr=subprocess.STDOUT,
                            env={**env, "TALLY_OPERATOR_METRICS_PORT": "0", "TALLY_OPERATOR_STATUS_INTERVAL": "5"})
    time.sleep(3)  # let it start watching; creation below is timed, not this
    pid = proc.pid
    if profile:  # measure the operator, not py-spy
        pid = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    try:
        items = [{"apiVersion": "serving.tally.dev/v1alpha1", "kind": "CompletionService",
                  "metadata": {"name": f"svc-{i}"}, "spec": SPEC} for i in range(n)]
        cpu0 = cpu_seconds(pid)
        start = time.perf_counter()
        apply_all(kubectl, ns, items)

        def all_ready() -> bool:
            got = kubectl.json("get", "completionservices", "-n", ns)["items"]
            ready = [c for c in got if any(x["type"] == "Ready" and x["status"] == "True"
                                           for x in (c.get("status") or {}).get("conditions") or [])]
            return len(ready) == n

        wait(all_ready, 1800)
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "cpu_seconds": cpu_seconds(pid) - cpu0, "peak_rss_mb": peak_rss_mb(pid)}
    finally:
        # Deleted while the operator runs: kopf's finalizers on the services need it (untimed).
        kubectl("delete", "namespace", ns, "--timeout=600s", check=False)
        os.kill(pid, signal.SIGTERM)  # the operator itself (under a profiler, py-spy then writes and exits)
        proc.wait(timeout=60)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape_round(pods: int) -> dict[str, float]:
    """One round over `pods` endpoints serving a real runtime's /metrics text."""
    sample = (ROOT / "benchmarks" / "runtime_metrics.txt").read_text().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(sample)))
            self.end_headers()
            self.wfile.write(sample)

        def log_message(self, *_: Any) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    urls = {f"pod-{i}": f"http://127.0.0.1:{port}/metrics?pod={i}" for i in range(pods)}
    try:
        start, cpu0 = time.perf_counter(), time.process_time()
        results = asyncio.run(scrape(urls, 16, 3.0))
        fetched = time.perf_counter() - start
        parsed = [parse_sample(text) for text in results.values() if isinstance(text, str)]
        total = time.perf_counter() - start
        return {"pods": pods, "ok": len(parsed), "seconds": total, "fetch_seconds": fetched,
                "client_cpu_seconds": time.process_time() - cpu0}
    finally:
        server.shutdown()


def tenant_metrics(pod: int, tenants: list[str], requests: dict[str, int] | None = None) -> str:
    """A runtime's /metrics text for one pod serving `tenants` (each `requests` of 20 + 10 tokens; 1 unless
    said)."""
    counts = {tenant: (requests or {}).get(tenant, 1) for tenant in tenants}
    total = sum(counts.values())
    head = (f'tally_runtime_info{{pod_uid="pod-{pod}"}} 1\ntally_start_time_seconds 1000\n'
            f'tally_requests_total{{endpoint="chat",outcome="ok",finish_reason="stop"}} {total}\n'
            f"tally_prompt_tokens_total {20 * total}\ntally_completion_tokens_total {10 * total}\n"
            "tally_cached_tokens_total 0\n")
    lines = []
    for tenant, n in counts.items():
        lines += [f'tally_tenant_requests_total{{tenant="{tenant}"}} {n}',
                  f'tally_tenant_prompt_tokens_total{{tenant="{tenant}"}} {20 * n}',
                  f'tally_tenant_completion_tokens_total{{tenant="{tenant}"}} {10 * n}',
                  f'tally_tenant_cached_tokens_total{{tenant="{tenant}"}} 0']
    return head + "\n".join(lines) + "\n"


def tenant_names(tenants: int, kind: str) -> list[str]:
    """`ascii`: tenant-00042; `cjk`: 128 characters, the most a runtime gives a name, 122 of them CJK (3 bytes
    each as stored, 6 escaped)."""
    if kind == "ascii":
        return [f"tenant-{i:05d}" for i in range(tenants)]
    letters = "漢字仮名交じり文勘定台帳"
    return [f"{i:05d}-" + "".join(letters[(i * 7 + j) % len(letters)] for j in range(122)) for i in range(tenants)]


def books_round(pods: int, tenants: int, names_kind: str = "ascii") -> dict[str, Any]:
    """One service's books with `tenants` in all over `pods` pods (each serves up to the per-pod bound), a
    default budget covering every tenant: the operator's own `plan` over its UsageShards (held as the API server
    would, as JSON), three rounds: the first (every shard created), one in which every tenant was served again
    (every shard changes), one in which one tenant was (one shard changes). The baseline, in the same run: the
    same books as one ledger in memory (as the status kept them before the shards, there at most 1,000 tenants;
    1.5 MiB is as much as one object can hold)."""
    import datetime

    from tally_operator.bookkeeping import Observed, plan
    from tally_operator.budget import BudgetConfig, TenantBudget, budgets_status, plan_budgets, state_from_status
    from tally_operator.observations import Observations
    from tally_operator.samples import MAX_TENANTS_PER_POD
    from tally_operator.shards import Shard
    from tally_operator.usage import Round, book, ledger_from_status, ledger_status

    names = tenant_names(tenants, names_kind)
    per_pod = min(MAX_TENANTS_PER_POD, tenants)
    served = {f"pod-{p}": [names[(p * per_pod + i) % tenants] for i in range(per_pod)] for p in range(pods)}
    texts = {uid: tenant_metrics(int(uid[4:]), served[uid]) for uid in served}
    start = time.perf_counter()
    samples = {uid: parse_sample(text, uid) for uid, text in texts.items()}
    parse_seconds = time.perf_counter() - start
    config = BudgetConfig("total", TenantBudget(monthly_tokens=10**9))
    now = datetime.datetime.now(datetime.UTC)

    start = time.perf_counter()  # the baseline: the same books as one ledger (as in the status before the shards)
    single = book(ledger_from_status({}), Round(samples, present=frozenset(samples)), capacity=tenants)
    single_budgets = plan_budgets(config, ledger_from_status({}), single.ledger, state_from_status({}),
                                  frozenset(samples), now, {uid: {} for uid in samples})
    single_bytes = len(json.dumps(ledger_status(single.ledger))) + len(json.dumps(budgets_status(single_budgets,
                                                                                                   config)))
    single_seconds = time.perf_counter() - start

    status: dict[str, Any] = {}
    stored: dict[int, tuple[str, int]] = {}
    rounds = []

    def one_round(round_samples: dict[str, Any]) -> dict[str, Any]:
        nonlocal status
        begin = time.perf_counter()
        read = {index: Shard(ledger_from_status(json.loads(body)["usage"]), str(rv), json.loads(body).get("budgets")
                             or {}) for index, (body, rv) in stored.items()}
        observed = Observed(1, [], {}, Round(round_samples, present=frozenset(round_samples)), budgets=config,
                            serving=frozenset(round_samples), shards=read, shard_key="bench-key")
        planned = plan(json.loads(json.dumps(status)), Observations(), observed, now.strftime("%Y-%m-%dT%H:%M:%SZ"))
        sizes = []
        for index, shard_body in planned.shards.items():
            text = json.dumps(shard_body, separators=(",", ":"), ensure_ascii=False)
            sizes.append(len(text.encode()))  # as the API server stores it (UTF-8)
            stored[index] = (text, stored.get(index, ("", 0))[1] + 1)
        status = json.loads(json.dumps(planned.status))
        seconds = time.perf_counter() - begin
        return {"seconds": seconds, "shards_written": len(planned.shards), "largest_shard_written_bytes":
                max(sizes, default=0), "status_bytes": len(json.dumps(status))}

    rounds.append(one_round(samples))
    twice = {uid: parse_sample(tenant_metrics(int(uid[4:]), served[uid], dict.fromkeys(served[uid], 2)), uid)
             for uid in served}  # every tenant served once more on every pod: every shard changes
    rounds.append(one_round(twice))
    first = served["pod-0"][0]
    once_more = {**twice, "pod-0": parse_sample(tenant_metrics(0, served["pod-0"], {
        **dict.fromkeys(served["pod-0"], 2), first: 3}), "pod-0")}  # one tenant served once more: one shard
    rounds.append(one_round(once_more))
    tenants_booked = sum(len(json.loads(body)["usage"].get("tenants") or {}) for body, _ in stored.values())
    folded = int(status.get("usage", {}).get("tenantsFolded", 0))
    return {"pods": pods, "tenants": tenants, "names": names_kind, "tenants_folded": folded,
            "tenants_per_pod": per_pod,
            "metrics_bytes_per_pod": len(next(iter(texts.values()))), "parse_seconds_all_pods": parse_seconds,
            "tenants_booked": tenants_booked, "shards": len(stored),
            "largest_shard_bytes": max(len(body.encode()) for body, _ in stored.values()),
            "all_shards_bytes": sum(len(body.encode()) for body, _ in stored.values()),
            "rounds": rounds,
            "baseline_one_ledger": {"seconds": single_seconds, "status_bytes": single_bytes,
                                    "ledger_tenants": len(single.ledger.tenants)},
            "first_round_vs_baseline": rounds[0]["seconds"] / single_seconds,
            "process_peak_rss_mb": peak_rss_mb(os.getpid())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", type=int, default=200)
    parser.add_argument("--pods", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=0,
                        help="also measure one service's books with this many tenants")
    parser.add_argument("--names", choices=["ascii", "cjk"], default="ascii",
                        help="the tenants' names: tenant-00042, or 128 characters mostly CJK")
    parser.add_argument("--json")
    args = parser.parse_args()
    report: dict[str, Any] = {"scrape_round": scrape_round(args.pods)}
    if args.tenants:
        report["books"] = books_round(min(args.pods, 50), args.tenants, args.names)
    if args.services:
        env = cluster_env()
        kubectl = Kubectl(env)
        report["services"] = args.services
        report["ceiling_seconds"] = ceiling(kubectl, args.services)
        # The next run starts on a quiet control plane: the ceiling's objects are gone first (untimed).
        kubectl("delete", "namespace", "bench-ceiling", "--timeout=600s", check=False)
        report["operator"] = operator_run(kubectl, env, args.services)
        report["ratio_vs_ceiling"] = report["operator"]["seconds"] / report["ceiling_seconds"]
        report["operator_mb_per_service"] = report["operator"]["peak_rss_mb"] / args.services
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
