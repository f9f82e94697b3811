"""Token budgets at admission: what reserving a request's worst case and settling it costs.

Two measurements. In this process: `Budgets.reserve` + `settle` with 1,000 tenants leased, the latency each
admission adds (p50, p99, max over many calls). Then two servers in their own processes (relay.py's `tally`
app over its model-free engine: plain, and with `--budgets` and a lease of 1,000 tenants, the bench's tenant
among them with a rate limit too), taking turns in every round as in journal.py; the median round is
reported: requests/s and server CPU per request, and the ratios against the plain runtime.

    python benchmarks/budgets.py [--streams 1,16] [--tokens 1,16] [--requests 4000] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import journal
import relay
from tally_runtime.budgets import Budgets

KINDS = ("tally", "tally-budgets")
TENANTS = 1000


SEQ = itertools.count(int(time.time() * 1000))  # lease messages are numbered, each above the last


def lease_message(epoch: float) -> dict[str, Any]:
    tenants: dict[str, Any] = {f"tenant-{i}": {"allowance": 10**12, "tokensPerMinute": 10**12} for i in range(TENANTS)}
    tenants["anonymous"] = {"allowance": 10**15, "tokensPerMinute": 10**15}  # the bench's requests name no tenant
    return {"epoch": epoch, "seq": next(SEQ), "count": "total", "tenants": tenants, "starter": {"allowance": 0}}


def admission_cost(calls: int = 200_000) -> dict[str, float]:
    """Microseconds per reserve + settle, with every tenant leased and rate-limited."""
    budgets = Budgets(counter=lambda tenant: 0.0, epoch=1.0)
    budgets.apply(lease_message(1.0), 1.0)
    samples = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        reservation = budgets.reserve(f"tenant-{i % TENANTS}", 100.0, now=i / 1e6)
        budgets.settle(reservation, 60.0)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return {"p50_us": samples[len(samples) // 2] / 1e3, "p99_us": samples[int(len(samples) * 0.99)] / 1e3,
            "max_us": samples[-1] / 1e3}


def post_leases(port: int) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        text = http.get("/metrics").text
        epoch = next(float(line.split()[1]) for line in text.splitlines()
                     if line.startswith("tally_start_time_seconds"))
        http.post("/internal/budgets", json=lease_message(epoch)).raise_for_status()


def run(streams: list[int], tokens: list[int], total: int, repeats: int) -> dict[str, Any]:
    report: dict[str, Any] = {"requests_per_point": total, "repeats": repeats, "admission": admission_cost(),
                              "results": {}}
    servers = {kind: relay.start_server(kind, "uvloop") for kind in KINDS}
    try:
        post_leases(servers["tally-budgets"][1])
        for c in streams:
            for t in tokens:
                rounds: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
                for r in range(repeats):
                    for kind in KINDS[r % 2:] + KINDS[:r % 2]:  # no server always goes first
                        proc, port = servers[kind]
                        rounds[kind].append(asyncio.run(journal.requests(port, proc.pid, c, t, total)))
                point = {k: sorted(v, key=lambda r: r["requests_per_s"])[len(v) // 2] for k, v in rounds.items()}
                point["throughput_ratio"] = relay.ratio(point["tally-budgets"]["requests_per_s"],
                                                        point["tally"]["requests_per_s"])
                point["cpu_ratio"] = relay.ratio(point["tally-budgets"]["cpu_ms_per_request"],
                                                 point["tally"]["cpu_ms_per_request"])
                report["results"][f"streams={c} tokens={t}"] = point
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--requests", type=int, default=4000, help="requests per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = run([int(s) for s in args.streams.split(",")], [int(t) for t in args.tokens.split(",")], args.requests,
                 args.repeats)
    a = report["admission"]
    print(f"reserve + settle: p50 {a['p50_us']:.1f} us, p99 {a['p99_us']:.1f} us, max {a['max_us']:.0f} us")
    for point, r in report["results"].items():
        print(f"{point:>20}: {r['tally-budgets']['requests_per_s']:.0f} vs {r['tally']['requests_per_s']:.0f} req/s "
              f"without: {r['throughput_ratio']:.3f}x throughput, {r['cpu_ratio']:.3f}x CPU per request "
              f"({r['tally-budgets']['cpu_ms_per_request']:.3f} vs {r['tally']['cpu_ms_per_request']:.3f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
