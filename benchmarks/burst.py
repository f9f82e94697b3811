"""The cost of a request: a burst of short streams against the coalescing ceiling, in one invocation.

Chat traffic is many short requests; what limits a front end then is what it spends per request, not per
token. The servers of benchmarks/relay.py (the coalescing ceiling, Tally's runtime over the CPU-free
engine, and with --adapter Tally over its SGLang adapter and the contract fake) each get R streaming
requests of T tokens from C clients at once. Each client keeps its connection open and sends its next
request when the last one ended, as a pooled SDK client does. Reported per server: requests/s, the
server's CPU per request, the time to first event p50/p99, and ratios against the ceiling. Servers take
turns within each round; the median round is reported.

    python benchmarks/burst.py [--requests 10000] [--concurrency 256] [--tokens 16] [--repeats 3]
                               [--adapter] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import BENCH_KEY, cpu_seconds, percentile, raise_open_files, ratio, start_server

END = b"0\r\n\r\n"  # the last chunk of a chunked response: the stream is over and the connection is reusable


async def client(port: int, tokens: int, todo: list[int], firsts: list[float], texts: list[int]) -> None:
    """One pooled client: one connection, requests back to back while any are left."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": "hello", "max_tokens": tokens, "stream": True, "model": "m"}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + BENCH_KEY.encode() + b"\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        while todo:
            todo.pop()
            sent = time.perf_counter()
            writer.write(request)
            seen, first, count = b"", 0.0, 0
            while not seen.endswith(END):
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed a pooled connection")
                if not first and b"data: " in data:
                    first = time.perf_counter() - sent
                seen = seen[-8:] + data
                count += data.count(b'"text":')
            firsts.append(first)
            texts.append(count)
    finally:
        writer.close()


async def measure(port: int, pid: int, requests: int, concurrency: int, tokens: int) -> dict[str, float]:
    await client(port, tokens, [0] * 8, [], [])  # warm up
    todo, firsts, texts = list(range(requests)), list[float](), list[int]()
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(client(port, tokens, todo, firsts, texts) for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    firsts.sort()
    return {
        "requests": len(firsts), "tokens": sum(texts), "expected": requests * tokens,
        "requests_per_s": len(firsts) / elapsed,
        "cpu_us_per_request": 1e6 * cpu / max(len(firsts), 1),
        "first_event_p50_ms": 1e3 * percentile(firsts, 0.5),
        "first_event_p99_ms": 1e3 * percentile(firsts, 0.99),
    }


def run(requests: int, concurrency: int, tokens: int, repeats: int, adapter: bool) -> dict[str, Any]:
    kinds = ("ceiling", "tally", "tally-sglang") if adapter else ("ceiling", "tally")
    raise_open_files()
    servers = {kind: start_server(kind, "uvloop") for kind in kinds}
    rounds: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    try:
        for _ in range(repeats):
            for kind, (proc, port) in servers.items():
                rounds[kind].append(asyncio.run(measure(port, proc.pid, requests, concurrency, tokens)))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    results = {}
    for kind, measured in rounds.items():
        measured.sort(key=lambda r: r["requests_per_s"])
        results[kind] = measured[len(measured) // 2]
    ceiling = results["ceiling"]
    ratios = {kind: {"requests_per_s": ratio(r["requests_per_s"], ceiling["requests_per_s"]),
                     "cpu_per_request": ratio(r["cpu_us_per_request"], ceiling["cpu_us_per_request"]),
                     "first_event_p50": ratio(r["first_event_p50_ms"], ceiling["first_event_p50_ms"]),
                     "first_event_p99": ratio(r["first_event_p99_ms"], ceiling["first_event_p99_ms"])}
              for kind, r in results.items() if kind != "ceiling"}
    return {"requests": requests, "concurrency": concurrency, "tokens": tokens, "repeats": repeats,
            "results": results, "ratios": ratios}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapter", action="store_true", help="also Tally over its SGLang adapter (contract fake)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run(args.requests, args.concurrency, args.tokens, args.repeats, args.adapter)
    for kind, r in report["results"].items():
        print(f"{kind:12} req/s={r['requests_per_s']:>8.0f} cpu/request={r['cpu_us_per_request']:>5.0f}us "
              f"first event p50={r['first_event_p50_ms']:.1f}ms p99={r['first_event_p99_ms']:.1f}ms "
              f"delivered={r['tokens']}/{r['expected']} tokens")
    for kind, r in report["ratios"].items():
        print(f"{kind} vs ceiling: {r['requests_per_s']:.2f}x req/s, {r['cpu_per_request']:.2f}x CPU per request, "
              f"first event p50 {r['first_event_p50']:.2f}x p99 {r['first_event_p99']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
