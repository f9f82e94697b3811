"""Tally against SGLang's own HTTP server, on SGLang 0.5.23's real engine on the CPU, in one invocation.

Two servers, each its own process tree, with the same engine arguments and the same checkpoint as the
real-SGLang tests (hack/sglang/env.sh, SGLANG_CONTRACT.md §9):
  sglang  `python -m sglang.launch_server`: what a user would run instead of Tally
  tally   `python -m tally_runtime serve --engine sglang`: Tally's front end over the same engine, in-process
One is up at a time (SGLang's scheduler polls while idle); they take turns, round by round. Streaming
`/v1/completions`, `/v1/chat/completions` and `/v1/responses` at each concurrency and output length; every
request asks for `ignore_eos` and usage in the stream, so a stream that finishes by `length` (for responses:
`response.incomplete`, cut at `max_output_tokens`) received exactly `max_tokens` tokens (what the usage it
reports must say). SGLang's own `/v1/responses` has no `ignore_eos`: a story prompt at temperature 0 runs to
the limit in practice, and a response that ends sooner counts as not completed.

Reported per server and cell: tokens/s and requests/s delivered, time to first token p50/p99, the gap between
events p99 at the client, CPU of the front process (the one that serves HTTP; the engine's scheduler and
detokenizer processes are apart) per token and per request, and the usage reported against the tokens
received. Then a cancellation round: streams whose clients leave after their first tokens, and what each
server has to bill for them (SGLang's own server: nothing; Tally: its ledger on /metrics).

Run it with SGLang's own python (hack/sglang/env.sh prints it):
    $(hack/sglang/env.sh) benchmarks/frontend.py [--concurrency 1,16,64] [--tokens 32,256] [--requests N]
                                                  [--repeats 1] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sglang_harness  # noqa: E402
from runtime_harness import wait_healthy  # noqa: E402
from sglang_harness import ENGINE_ARGS, MODEL  # noqa: E402

from relay import cpu_seconds, free_port, percentile, raise_open_files  # noqa: E402
from tally_runtime.contract import COMPLETION_TOKENS  # noqa: E402

SERVED = "m"
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def command(kind: str, port: int, slots: int) -> list[str]:
    """The same engine, the same arguments: SGLang's own flags for its server, Tally's `--engine-arg` for ours."""
    if kind == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODEL), "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", SERVED, "--log-level", "warning",
                f"--max-running-requests={slots}", *ENGINE_ARGS]
    return [sys.executable, "-m", "tally_runtime", "serve", "--engine", "sglang", "--model-path", str(MODEL),
            "--port", str(port), "--served-model-name", SERVED, "--max-concurrent-generations", str(slots),
            "--max-running-requests", str(slots), "--log-level", "warning",
            *(f"--engine-arg={arg}" for arg in ENGINE_ARGS)]


def start(kind: str, slots: int, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc, _ = sglang_harness.start(command(kind, port, slots), log)  # its own session: stop() ends the tree
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log, deadline=600)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def engine_pids(pid: int) -> list[int]:
    """The front process's descendants: SGLang's scheduler and detokenizer (and its resource tracker)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_cpu(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


@dataclass
class Stream:
    first_token_s: float = 0.0
    gaps: list[float] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    error: str = ""


def body(route: str, tokens: int) -> bytes:
    if route == "responses":  # usage comes in response.completed (or .incomplete, when cut at the limit)
        return json.dumps({"model": SERVED, "input": PROMPT, "max_output_tokens": tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True}).encode()  # SGLang's own ignores ignore_eos
    request: dict[str, Any] = {"model": SERVED, "max_tokens": tokens, "stream": True, "ignore_eos": True,
                               "temperature": 0, "stream_options": {"include_usage": True}}
    if route == "chat":
        request["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        request["prompt"] = PROMPT
    return json.dumps(request).encode()


DATA = re.compile(rb"^data: (.*)$", re.M)


async def one(port: int, route: str, tokens: int, leave_after: int = 0) -> Stream:
    """One streaming request on its own connection; with `leave_after`, the client closes after that many
    events with text."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = body(route, tokens)
    seen, last, texts = Stream(), 0.0, 0
    sent = time.perf_counter()
    writer.write(f"POST {ROUTES[route]} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    buffer, first_read = b"", True
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            if first_read:  # its status line
                first_read, status = False, data.split(b"\r\n", 1)[0]
                if b" 200 " not in status:
                    seen.error = status.decode(errors="replace")
                    break
            buffer += data
            complete, _, buffer = buffer.rpartition(b"\n\n")
            done = False
            for match in DATA.finditer(complete):
                if match.group(1) == b"[DONE]":
                    done = True
                    continue
                event = json.loads(match.group(1))
                pieces = []
                if route == "responses":
                    pieces.append(_responses_event(event, seen))
                    done = done or event.get("type") in TERMINAL
                else:
                    if event.get("usage"):
                        seen.usage = event["usage"]
                    if "error" in event:
                        seen.error = str(event["error"])
                    for choice in event.get("choices") or []:
                        pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content"))
                        seen.finish = choice.get("finish_reason") or seen.finish
                for piece in pieces:
                    if piece:  # a text event: the first token's time, or the gap since the last
                        texts += 1
                        if not seen.first_token_s:
                            seen.first_token_s = now - sent
                        elif last:
                            seen.gaps.append(now - last)
                        last = now
            if done or (leave_after and texts >= leave_after):
                break
    finally:
        writer.close()
    return seen


def _responses_event(event: dict[str, Any], seen: Stream) -> str:
    """A Responses API event: its text delta, if any; the usage and the finish from the last one."""
    kind = event.get("type")
    if kind == "response.output_text.delta":
        return str(event.get("delta") or "")
    if kind in TERMINAL:
        response = event.get("response") or {}
        usage = response.get("usage") or {}
        seen.usage = {"completion_tokens": usage.get("output_tokens", 0)}
        cut = (response.get("incomplete_details") or {}).get("reason") == "max_output_tokens"
        seen.finish = "length" if cut else ("stop" if kind == "response.completed" else None)
        if kind == "response.failed":
            seen.error = str(response.get("error"))
    elif kind == "error":
        seen.error = str(event.get("message"))
    return ""


async def cell(port: int, pids: list[int], route: str, concurrency: int, tokens: int, requests: int) -> dict[str, Any]:
    """`requests` streams, `concurrency` at a time."""
    queue = list(range(requests))
    results: list[Stream] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            results.append(await one(port, route, tokens))

    front0, engine0, t0 = cpu_seconds(pids[0]), tree_cpu(pids[1:]), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    front, engine = cpu_seconds(pids[0]) - front0, tree_cpu(pids[1:]) - engine0
    finished = [r for r in results if r.finish == "length" and not r.error]
    received = tokens * len(finished)
    reported = sum(int((r.usage or {}).get("completion_tokens", 0)) for r in results)
    ttft = sorted(r.first_token_s for r in results if r.first_token_s)
    gaps = sorted(g for r in results for g in r.gaps)
    return {
        "requests": requests, "completed": len(finished), "errors": [r.error for r in results if r.error][:3],
        "tokens_received": received, "completion_tokens_reported": reported,
        "usage_exact": reported == received and len(finished) == requests,
        "tokens_per_s": received / elapsed, "requests_per_s": len(finished) / elapsed,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "gap_p99_ms": 1e3 * percentile(gaps, 0.99),
        "front_cpu_ms_per_token": 1e3 * front / max(received, 1),
        "front_cpu_ms_per_request": 1e3 * front / max(requests, 1),
        "engine_cpu_ms_per_token": 1e3 * engine / max(received, 1),
    }


def tally_billed(port: int) -> int:
    """Completion tokens in Tally's ledger so far (its usage counters on /metrics, all tenants)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(COMPLETION_TOKENS + "_total"))


async def cancellation(port: int, route: str, streams: int, tokens: int, leave_after: int) -> dict[str, Any]:
    """`streams` clients that leave after `leave_after` text events: what reached them, and what usage they got."""
    results = await asyncio.gather(*(one(port, route, tokens, leave_after) for _ in range(streams)))
    return {"streams": streams, "usage_received": sum(int((r.usage or {}).get("completion_tokens", 0))
                                                      for r in results)}


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("nan")


def serve_and_measure(kind: str, cells: Sequence[tuple[str, int, int]], requests: int,
                      logs: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Start one server, warm it, measure every cell on it, then its cancellation round; stop it."""
    proc, port = start(kind, max(c for _, c, _ in cells), logs / f"{kind}.log")
    try:
        pids = [proc.pid, *engine_pids(proc.pid)]
        for route in ROUTES:  # SGLang's own warm-up is skipped for both (--skip-server-warmup)
            asyncio.run(one(port, route, 8))
        measured = {}
        for route, c, n in cells:
            measured[f"{route} c={c} n={n}"] = asyncio.run(cell(port, pids, route, c, n, max(requests, c)))
            print(kind, route, c, n, json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                 for k, v in measured[f"{route} c={c} n={n}"].items()}), flush=True)
        before = tally_billed(port) if kind == "tally" else 0
        cancelled = asyncio.run(cancellation(port, "chat", 16, 256, 4))
        if kind == "tally":  # the ledger settles once the aborted generations have ended
            deadline = time.monotonic() + 60
            while tally_billed(port) - before < 16 * 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            cancelled["ledger_completion_tokens"] = tally_billed(port) - before
        return measured, cancelled
    finally:
        stop(proc)


def run(concurrency: Sequence[int], tokens: Sequence[int], requests: int, repeats: int,
        logs: Path) -> dict[str, Any]:
    """One server at a time: SGLang's scheduler polls while idle and would take a core from the other.
    The servers take turns, in alternating order from round to round; the median round per cell is kept."""
    cells = [(route, c, n) for route in ROUTES for c in concurrency for n in tokens]
    report: dict[str, Any] = {"model": MODEL.name, "engine_args": list(ENGINE_ARGS), "slots": max(concurrency),
                              "results": {}, "ratios": {}, "cancellation": {}}
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {"sglang": [], "tally": []}
    for i in range(repeats):
        for kind in (("sglang", "tally") if i % 2 == 0 else ("tally", "sglang")):
            measured, cancelled = serve_and_measure(kind, cells, requests, logs)
            rounds[kind].append(measured)
            report["cancellation"][kind] = cancelled
    for kind, measured_rounds in rounds.items():
        for key in measured_rounds[0]:
            ordered = sorted((m[key] for m in measured_rounds), key=lambda r: r["tokens_per_s"])
            report["results"].setdefault(kind, {})[key] = ordered[len(ordered) // 2]
    for key in report["results"]["tally"]:
        ours, theirs = report["results"]["tally"][key], report["results"]["sglang"][key]
        report["ratios"][key] = {name: ratio(ours[name], theirs[name]) for name in (
            "tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "gap_p99_ms",
            "front_cpu_ms_per_token", "front_cpu_ms_per_request")}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--tokens", default="32,256")
    parser.add_argument("--requests", type=int, default=4, help="streams per cell at least (at least the concurrency)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per cell; the median is reported")
    parser.add_argument("--logs", default="/tmp/tally-frontend")
    parser.add_argument("--json")
    args = parser.parse_args()
    raise_open_files()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    report = run([int(c) for c in args.concurrency.split(",")], [int(n) for n in args.tokens.split(",")],
                 args.requests, args.repeats, logs)
    for key, r in report["ratios"].items():
        t, s = report["results"]["tally"][key], report["results"]["sglang"][key]
        print(f"{key:22} tally/sglang: tok/s {r['tokens_per_s']:.2f}x, TTFT p50 {r['ttft_p50_ms']:.2f}x "
              f"p99 {r['ttft_p99_ms']:.2f}x, gap p99 {r['gap_p99_ms']:.2f}x, front CPU/token "
              f"{r['front_cpu_ms_per_token']:.2f}x, /request {r['front_cpu_ms_per_request']:.2f}x; "
              f"usage exact: tally {t['usage_exact']}, sglang {s['usage_exact']}")
    print("cancellation:", json.dumps(report["cancellation"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    inexact = [key for key, r in report["results"]["tally"].items() if not r["usage_exact"]]
    if inexact:  # a benchmark, but also the smoke check that Tally's usage is what its clients received
        sys.exit(f"Tally's usage differs from the tokens received in: {', '.join(inexact)}")


if __name__ == "__main__":
    main()
