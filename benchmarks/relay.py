"""Relay overhead: Tally's SSE path against two baselines in the same invocation.

Four servers, each in its own process under uvicorn on loopback, stream N tokens per request from an
engine that yields as fast as it can (no model):
  naive     a bare ASGI app sending precomputed bytes, one event per write
  ceiling   a bare ASGI app whose token source runs in its own task and whose writer sends every event
            that is ready in one write (as Tally does): the limit of uvicorn and the socket
  pydantic  a FastAPI route building a pydantic model per chunk (model_dump_json), as common servers do
  tally     the real runtime app (create_app) over the same token source
With --adapter, a fourth: tally-sglang, the runtime over the SGLang adapter and the SGLang contract fake
with a zero-cost token source (tests/fakes/sglang), so the adapter's own per-item work is measured, as a
ratio against the tally server's CPU-free engine path.
An asyncio client reads every byte of C concurrent streams. Reported per server: tokens/s delivered,
inter-chunk gap p50/p99 at the client, server CPU seconds per 1k tokens, the server's resident memory per
open stream; and ratios against both baselines.

    python benchmarks/relay.py [--streams 1,64,256] [--tokens 256] [--repeats 3] [--min-tokens N]
                                [--stack uvloop|asyncio] [--adapter] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fakes"))  # the CPU-free token source, and the contract fake as `sglang`

from fast_engine import FastEngine  # noqa: E402

from tally_runtime.engine.base import GenerationRequest, SamplingParams  # noqa: E402

# ---- the three servers (run in child processes: `relay.py serve <kind> <port>`)

EVENT = (b'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
         b'"text":" tok","logprobs":null,"finish_reason":null}],"usage":null}\n\n')
DONE = b"data: [DONE]\n\n"


async def _bare_request(receive: Any) -> int:
    """The tokens a bare app is asked for: the body's `max_tokens`, however many messages it came in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return int(json.loads(body or b"{}").get("max_tokens", 256))


def naive_app() -> Any:
    """The per-token ceiling: a bare ASGI app sending one precomputed event per write."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        tokens = await _bare_request(receive)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(tokens):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            if i % 16 == 0:
                await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    return app


def ceiling_app() -> Any:
    """The coalescing ceiling: a bare ASGI app whose token source runs in its own task (as an engine's output
    does) and whose writer sends every event that is ready in one write, as Tally's relay does; nothing else.
    The token source hands control back every 16 tokens, like the benchmark engine."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        tokens = await _bare_request(receive)
        ready: list[bytes] = []
        wake: list[asyncio.Future[None]] = []
        finished = False

        def notify() -> None:
            if wake and not wake[0].done():
                wake.pop().set_result(None)

        async def source() -> None:
            nonlocal finished
            for i in range(1, tokens + 1):
                ready.append(EVENT)
                notify()
                if i % 16 == 0:
                    await asyncio.sleep(0)
            finished = True
            notify()

        task = asyncio.create_task(source())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        while True:
            if not ready and not finished:
                wake[:] = [asyncio.get_running_loop().create_future()]
                await wake[0]
                continue
            if not ready:
                break
            batch = b"".join(ready)
            ready.clear()
            await send({"type": "http.response.body", "body": batch, "more_body": True})
        await task
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    return app


class Choice(BaseModel):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None


class Chunk(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Any = None


class CompletionBody(BaseModel):
    prompt: str
    max_tokens: int = 16
    stream: bool = False


def pydantic_app() -> Any:
    """The straightforward implementation: a pydantic model built and dumped per chunk."""
    app = FastAPI()
    engine = FastEngine()

    @app.post("/v1/completions")
    async def complete(body: CompletionBody) -> StreamingResponse:
        gen = GenerationRequest("r.", engine.tokenize(body.prompt), SamplingParams(max_tokens=body.max_tokens))

        async def stream() -> AsyncIterator[str]:
            async for delta in engine.generate(gen):
                chunk = Chunk(id="cmpl-x", created=int(time.time()), model="m", choices=[
                    Choice(index=0, text=delta.text,
                           finish_reason=str(delta.finish_reason) if delta.finish_reason else None)])
                yield f"data: {chunk.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def tally_app(journal_path: str = "", records_file: str = "", api_keys_file: str = "", budgets: bool = False) -> Any:
    """The runtime; per-request bookkeeping (journal, usage records, API keys, budgets) only where
    benchmarks/journal.py or benchmarks/budgets.py asks."""
    from tally_runtime.app import create_app
    from tally_runtime.settings import Settings

    # benchmarks/budget_waits.py paces the tokens, so that requests overlap as on a real node
    pace = float(os.environ.get("TALLY_BENCH_TOKEN_SECONDS", "0"))
    return create_app(Settings(max_concurrent_generations=100_000, served_model_name="m", journal_path=journal_path,
                               usage_records=False, usage_records_file=records_file, api_keys_file=api_keys_file,
                               budgets=budgets), FastEngine(pace))


def sglang_app() -> Any:
    """The runtime over the SGLang adapter and the contract fake of SGLang 0.5.23, tokens from no model."""
    os.environ["FAKE_SGLANG_ZERO_COST"] = "1"
    from tally_runtime.app import create_app
    from tally_runtime.engine.sglang import SGLangEngine
    from tally_runtime.settings import Settings

    settings = Settings(engine="sglang", model_path="/models/fake", served_model_name="m",
                        max_concurrent_generations=100_000, usage_records=False, context_length=1 << 20)
    return create_app(settings, SGLangEngine(settings.engine_config()))


STACKS = {"uvloop": {"loop": "uvloop", "http": "httptools"}, "asyncio": {"loop": "asyncio", "http": "h11"}}


def serve(kind: str, port: int, stack: str) -> None:
    import uvicorn

    apps = {"ceiling": ceiling_app, "naive": naive_app, "pydantic": pydantic_app, "tally": tally_app,
            # the runtime with its counter journal, or its usage records, on (benchmarks/journal.py)
            "tally-journal": lambda: tally_app(journal_path=os.environ["TALLY_BENCH_JOURNAL"]),
            "tally-records": lambda: tally_app(records_file=os.environ["TALLY_BENCH_RECORDS"]),
            "tally-keys": lambda: tally_app(api_keys_file=os.environ["TALLY_BENCH_KEYS"]),
            "tally-budgets": lambda: tally_app(budgets=True),  # leases posted by benchmarks/budgets.py
            "tally-sglang": sglang_app}
    app = apps[kind]()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, **STACKS[stack])


# ---- the client

# Every request carries an API key, as an OpenAI client's does: servers without keys ignore it, so every
# server gets the same bytes (benchmarks/journal.py's tally-keys checks it).
BENCH_KEY = "sk-bench-0123456789abcdef0123"


@dataclass
class StreamReads:
    """What one client saw of one stream: every `"text":` it read (one per token on every server), when the
    first event came, and per later read its gap since the previous one and the events it brought."""

    texts: int = 0
    first_event_s: float = 0.0
    first_read_events: int = 1
    reads: list[tuple[float, int]] = field(default_factory=list)


async def one_stream(port: int, tokens: int) -> tuple[int, StreamReads]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": "hello", "max_tokens": tokens, "stream": True, "model": "m"}).encode()
    sent = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + BENCH_KEY.encode() + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    seen = StreamReads()
    tail = b""  # the previous read's last bytes, one fewer than a marker: a split marker is counted once
    last = 0.0
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.perf_counter()
        window = tail + data
        new = window[1:].count(b"data: ")  # one per event, whatever the HTTP chunking around it
        if new:
            if last:
                seen.reads.append((now - last, new))
            else:
                seen.first_event_s, seen.first_read_events = now - sent, new
            last = now
        seen.texts += window.count(b'"text":')  # 7 bytes
        tail = window[-6:]
        if window.endswith((b"data: [DONE]\n\n", b"0\r\n\r\n")):
            break
    writer.close()
    return seen.texts, seen


def percentile(values: Sequence[float], q: float) -> float:
    return values[int(q * (len(values) - 1))] if values else 0.0


def gap_stats(streams: Sequence[StreamReads]) -> dict[str, float]:
    """Inter-event gaps at the client. Per event: a read that brought k events after a gap g counts k events
    g/k apart (a batched write is k events, not one), and a stream's first event is its time to first
    event, reported apart. Per read: the definition recorded before 4,096 streams (one sample per read,
    the first read's wait included), kept to compare runs across it."""
    per_event = sorted(g / k for s in streams for g, k in s.reads for _ in range(k))
    per_read = sorted([g / k for s in streams for g, k in s.reads]
                      + [s.first_event_s / s.first_read_events for s in streams])
    first = sorted(s.first_event_s for s in streams)
    return {
        "gap_p50_us": 1e6 * percentile(per_event, 0.5),
        "gap_p99_us": 1e6 * percentile(per_event, 0.99),
        "read_gap_p50_us": 1e6 * percentile(per_read, 0.5),
        "read_gap_p99_us": 1e6 * percentile(per_read, 0.99),
        "first_event_p50_ms": 1e3 * percentile(first, 0.5),
        "first_event_p99_ms": 1e3 * percentile(first, 0.99),
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(port: int, pid: int, streams: int, tokens: int, min_tokens: int) -> dict[str, float]:
    """`streams` clients at once, each sending its requests back to back until `min_tokens` are due in all
    (so one stream is timed over many requests, not over a few milliseconds)."""
    await one_stream(port, 32)  # warm up
    per_client = max(1, -(-min_tokens // (streams * tokens)))

    async def client() -> list[tuple[int, StreamReads]]:
        return [await one_stream(port, tokens) for _ in range(per_client)]

    peak_rss = [rss_bytes(pid)]

    async def sample_memory() -> None:  # the server's memory while the streams are open
        while True:
            peak_rss[0] = max(peak_rss[0], rss_bytes(pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample_memory())
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    results = [r for rs in await asyncio.gather(*(client() for _ in range(streams))) for r in rs]
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    sampler.cancel()
    delivered = sum(r[0] for r in results)
    return {
        "requests": len(results),
        "tokens": delivered,
        "expected": len(results) * tokens,
        "tokens_per_s": delivered / elapsed,
        **gap_stats([r[1] for r in results]),
        "cpu_s_per_1k_tokens": 1000 * cpu / max(delivered, 1),
        "peak_rss_bytes": peak_rss[0],
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(kind: str, stack: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "serve", kind, str(port), stack], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            import socket

            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def raise_open_files() -> None:
    """4,096 streams need as many sockets on each side: the soft limit up to the hard one (servers inherit it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def ratio(ours: float, theirs: float) -> float:
    """NaN when the baseline measured nothing (short smoke runs fall below the 10 ms CPU clock tick)."""
    return ours / theirs if theirs else float("nan")


KINDS = ("naive", "ceiling", "pydantic", "tally")


def run(streams: Sequence[int], tokens: int, repeats: int, min_tokens: int, stack: str,
        adapter: bool = False) -> dict[str, Any]:
    """All servers up at once; each stream count is measured `repeats` times, the servers taking turns
    within every round, and the round with the median throughput is reported per server. A neighbour's
    burst on a shared machine then lands on all of them alike instead of on one run."""
    kinds = (*KINDS, "tally-sglang") if adapter else KINDS
    report: dict[str, Any] = {"tokens_per_stream": tokens, "repeats": repeats, "min_tokens": min_tokens, "stack": stack,
                              "results": {k: {} for k in kinds}}
    raise_open_files()
    servers = {kind: start_server(kind, stack) for kind in kinds}
    idle_rss = {}
    for kind, (proc, port) in servers.items():  # resident memory after one request: the server at rest
        asyncio.run(one_stream(port, 32))
        idle_rss[kind] = rss_bytes(proc.pid)
    try:
        for c in streams:
            rounds: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
            for _ in range(repeats):
                for kind, (proc, port) in servers.items():
                    rounds[kind].append(asyncio.run(measure(port, proc.pid, c, tokens, min_tokens)))
            for kind, measured in rounds.items():
                # Memory per open stream: the highest resident size seen with `c` streams open, over the
                # size at rest (memory a process once took stays counted: it is what the pod must have).
                peak = max(r["peak_rss_bytes"] for r in measured)
                measured.sort(key=lambda r: r["tokens_per_s"])
                report["results"][kind][str(c)] = measured[len(measured) // 2] | {
                    "rss_kib_per_stream": max(0, peak - idle_rss[kind]) / 1024 / c}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    ratios: dict[str, Any] = {}
    for c in map(str, streams):
        r = report["results"]
        ratios[c] = {
            "throughput_vs_ceiling": ratio(r["tally"][c]["tokens_per_s"], r["ceiling"][c]["tokens_per_s"]),
            "throughput_vs_naive": ratio(r["tally"][c]["tokens_per_s"], r["naive"][c]["tokens_per_s"]),
            "cpu_vs_naive": ratio(r["tally"][c]["cpu_s_per_1k_tokens"], r["naive"][c]["cpu_s_per_1k_tokens"]),
            "first_event_p50_vs_ceiling": ratio(r["tally"][c]["first_event_p50_ms"],
                                                r["ceiling"][c]["first_event_p50_ms"]),
            "throughput_vs_pydantic": ratio(r["tally"][c]["tokens_per_s"], r["pydantic"][c]["tokens_per_s"]),
            "cpu_vs_ceiling": ratio(r["tally"][c]["cpu_s_per_1k_tokens"], r["ceiling"][c]["cpu_s_per_1k_tokens"]),
            "cpu_vs_pydantic": ratio(r["tally"][c]["cpu_s_per_1k_tokens"], r["pydantic"][c]["cpu_s_per_1k_tokens"]),
            "p99_gap_vs_ceiling": ratio(r["tally"][c]["gap_p99_us"], r["ceiling"][c]["gap_p99_us"]),
            "p99_read_gap_vs_ceiling": ratio(r["tally"][c]["read_gap_p99_us"], r["ceiling"][c]["read_gap_p99_us"]),
        }
        if adapter:
            ratios[c] |= {
                "adapter_throughput_vs_tally": ratio(r["tally-sglang"][c]["tokens_per_s"],
                                                     r["tally"][c]["tokens_per_s"]),
                "adapter_cpu_vs_tally": ratio(r["tally-sglang"][c]["cpu_s_per_1k_tokens"],
                                              r["tally"][c]["cpu_s_per_1k_tokens"]),
                "adapter_p99_gap_vs_tally": ratio(r["tally-sglang"][c]["gap_p99_us"], r["tally"][c]["gap_p99_us"]),
                "adapter_throughput_vs_ceiling": ratio(r["tally-sglang"][c]["tokens_per_s"],
                                                       r["ceiling"][c]["tokens_per_s"]),
                "adapter_cpu_vs_ceiling": ratio(r["tally-sglang"][c]["cpu_s_per_1k_tokens"],
                                                r["ceiling"][c]["cpu_s_per_1k_tokens"]),
                "adapter_p99_gap_vs_ceiling": ratio(r["tally-sglang"][c]["gap_p99_us"],
                                                    r["ceiling"][c]["gap_p99_us"]),
            }
    report["ratios"] = ratios
    return report


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,64,256")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per stream count; the median is reported")
    parser.add_argument("--min-tokens", type=int, default=262_144,
                        help="tokens per measurement at least: fewer streams send more requests each")
    parser.add_argument("--stack", choices=sorted(STACKS), default="uvloop",
                        help="uvicorn's event loop and HTTP parser, the same for all three servers")
    parser.add_argument("--adapter", action="store_true", help="also the SGLang adapter over a zero-cost fake")
    parser.add_argument("--json")
    args = parser.parse_args()
    report = run([int(s) for s in args.streams.split(",")], args.tokens, args.repeats, args.min_tokens, args.stack,
                 args.adapter)
    for kind, by_c in report["results"].items():
        for c, r in by_c.items():
            print(f"{kind:12} streams={c:>4} tok/s={r['tokens_per_s']:>10.0f} delivered={r['tokens']}/{r['expected']} "
                  f"gap p50={r['gap_p50_us']:.0f}us p99={r['gap_p99_us']:.0f}us "
                  f"(per read {r['read_gap_p99_us']:.0f}us) "
                  f"first event p50={r['first_event_p50_ms']:.0f}ms p99={r['first_event_p99_ms']:.0f}ms "
                  f"cpu/1k tok={r['cpu_s_per_1k_tokens'] * 1000:.1f}ms rss/stream={r['rss_kib_per_stream']:.0f}KiB")
    for c, r in report["ratios"].items():
        print(f"tally streams={c:>4}: {r['throughput_vs_ceiling']:.2f}x ceiling, "
              f"{r['throughput_vs_pydantic']:.2f}x pydantic throughput; "
              f"CPU per token {r['cpu_vs_ceiling']:.2f}x ceiling, {r['cpu_vs_pydantic']:.2f}x pydantic; "
              f"p99 gap {r['p99_gap_vs_ceiling']:.2f}x ceiling (per read {r['p99_read_gap_vs_ceiling']:.2f}x); "
              f"first event p50 {r['first_event_p50_vs_ceiling']:.2f}x ceiling; "
              f"vs naive {r['throughput_vs_naive']:.2f}x throughput, {r['cpu_vs_naive']:.2f}x CPU"
              + (f"; adapter vs tally: {r['adapter_throughput_vs_tally']:.2f}x throughput, "
                 f"{r['adapter_cpu_vs_tally']:.2f}x CPU, {r['adapter_p99_gap_vs_tally']:.2f}x p99 gap; "
                 f"adapter vs ceiling: {r['adapter_throughput_vs_ceiling']:.2f}x throughput, "
                 f"{r['adapter_cpu_vs_ceiling']:.2f}x CPU, {r['adapter_p99_gap_vs_ceiling']:.2f}x p99 gap"
                 if "adapter_cpu_vs_tally" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
