"""Per-request bookkeeping: the counter journal, the usage records and API-key checking, each against the
runtime without it.

Four servers run at once in their own processes (relay.py's `tally` app over its model-free engine: plain,
with `--journal-path`, with `--usage-records-file`, with `--api-keys-file` of 100 keys: every request carries
a key either way) and take turns in every round, each round starting with
the next one; the median round is reported per server; short requests make the
per-request write as visible as it can be. Reported: requests/s and server CPU per request, the ratios
against the plain runtime, and the cost of one journal write and one record measured in this process.

    python benchmarks/journal.py [--streams 1,16] [--tokens 1,16] [--requests 4000] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import relay
from tally_runtime.ledger import Journal, Totals
from tally_runtime.records import RecordSink, UsageRecord

KINDS = ("tally", "tally-journal", "tally-records", "tally-keys")


async def requests(port: int, pid: int, streams: int, tokens: int, total: int) -> dict[str, float]:
    per_client = max(1, total // streams)

    async def client() -> int:
        for _ in range(per_client):
            delivered, _ = await relay.one_stream(port, tokens)
            assert delivered == tokens, f"{delivered} of {tokens} tokens"
        return per_client

    await relay.one_stream(port, tokens)  # warm up
    cpu0, t0 = relay.cpu_seconds(pid), time.perf_counter()
    done = sum(await asyncio.gather(*(client() for _ in range(streams))))
    elapsed, cpu = time.perf_counter() - t0, relay.cpu_seconds(pid) - cpu0
    return {"requests": done, "requests_per_s": done / elapsed, "cpu_ms_per_request": 1000 * cpu / done}


def write_cost(writes: int = 5000) -> float:
    """Microseconds per journal write of a realistic snapshot (a few dozen label sets)."""
    totals = Totals(requests={f"completions|ok|reason{i}": float(i) for i in range(24)}, prompt_tokens=1e9,
                    completion_tokens=2e9)
    with tempfile.TemporaryDirectory() as folder:
        journal = Journal(Path(folder) / "usage.json")
        t0 = time.perf_counter()
        for i in range(writes):
            totals.completion_tokens += i
            journal.write(totals)
        return 1e6 * (time.perf_counter() - t0) / writes


def record_cost(writes: int = 5000) -> float:
    """Microseconds per usage record appended to a file."""
    record = UsageRecord(id="cmpl-0123456789abcdef0123456789abcdef", time=time.time(), model="m",
                         endpoint="completions", tenant="team-a", tenant_source="key", outcome="ok",
                         finish_reasons=("length",), n=1,
                         stream=True, prompt_tokens=12, completion_tokens=64, cached_tokens=0, reasoning_tokens=0,
                         derived=False, time_to_first_token_seconds=0.01, duration_seconds=0.5)
    with tempfile.TemporaryDirectory() as folder:
        sink = RecordSink(stdout=False, path=str(Path(folder) / "usage.jsonl"))
        t0 = time.perf_counter()
        for _ in range(writes):
            sink.write(record)
        elapsed = time.perf_counter() - t0
        sink.close()
    return 1e6 * elapsed / writes


def run(streams: list[int], tokens: list[int], total: int, repeats: int) -> dict[str, Any]:
    report: dict[str, Any] = {"requests_per_point": total, "repeats": repeats, "write_us": write_cost(),
                              "record_us": record_cost(), "results": {}}
    with tempfile.TemporaryDirectory() as folder:
        os.environ["TALLY_BENCH_JOURNAL"] = str(Path(folder) / "usage.json")
        os.environ["TALLY_BENCH_RECORDS"] = str(Path(folder) / "usage.jsonl")
        keys = Path(folder) / "api-keys"
        keys.write_text("".join(f"tenant-{i} sk-tenant-{i:04d}-0123456789abcdef\n" for i in range(99))
                        + f"bench {relay.BENCH_KEY}\n")
        os.environ["TALLY_BENCH_KEYS"] = str(keys)
        servers = {kind: relay.start_server(kind, "uvloop") for kind in KINDS}
        try:
            for c in streams:
                for t in tokens:
                    rounds: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
                    for r in range(repeats):
                        order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]  # no server always goes first
                        for kind in order:
                            proc, port = servers[kind]
                            rounds[kind].append(asyncio.run(requests(port, proc.pid, c, t, total)))
                    point = {k: sorted(v, key=lambda r: r["requests_per_s"])[len(v) // 2] for k, v in rounds.items()}
                    for kind in KINDS[1:]:
                        point[f"{kind}_throughput_ratio"] = relay.ratio(point[kind]["requests_per_s"],
                                                                        point["tally"]["requests_per_s"])
                        point[f"{kind}_cpu_ratio"] = relay.ratio(point[kind]["cpu_ms_per_request"],
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
    print(f"one journal write: {report['write_us']:.1f} us; one usage record: {report['record_us']:.1f} us")
    for point, r in report["results"].items():
        for kind in KINDS[1:]:
            print(f"{point:>20} {kind:>13}: {r[kind]['requests_per_s']:.0f} vs {r['tally']['requests_per_s']:.0f} "
                  f"req/s without: {r[f'{kind}_throughput_ratio']:.3f}x throughput, "
                  f"{r[f'{kind}_cpu_ratio']:.3f}x CPU per request")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
