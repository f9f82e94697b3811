"""Usage truth under load: many concurrent streams through the SGLang adapter, the fake engine coalescing.

The contract fake (tests/fakes/sglang, generation D, incremental) is forced into backlog coalescing; every
client's text must equal its unloaded run and its usage must be the engine's, with zero mismatches.

    python benchmarks/usage_truth.py [--streams 256] [--tokens 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fakes"))

import sglang  # noqa: E402  (the contract fake)

from tally_runtime.app import create_app  # noqa: E402
from tally_runtime.engine.sglang import SGLangEngine  # noqa: E402
from tally_runtime.settings import Settings  # noqa: E402

PROMPTS = [f"Write a sentence about the number {i}." for i in range(16)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, chunks = "", None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"]:
                text += event["choices"][0]["text"]
                chunks += 1
            usage = event.get("usage") or usage
    return {"text": text, "usage": usage, "chunks": chunks}


async def drive(url: str, streams: int, tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        reference = {p: await stream(client, url, p, tokens) for p in PROMPTS}
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(client, url, PROMPTS[i % len(PROMPTS)], tokens)
                                         for i in range(streams)))
        elapsed = time.perf_counter() - started
        metrics = (await client.get(f"{url}/metrics")).text
    wrong_text = sum(r["text"] != reference[PROMPTS[i % len(PROMPTS)]]["text"] for i, r in enumerate(results))
    wrong_usage = sum(r["usage"]["completion_tokens"] != tokens for r in results)
    mismatches = sum(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("tally_usage_mismatches_total"))
    chunks = sum(r["chunks"] for r in results)
    return {"streams": streams, "tokens_per_stream": tokens, "elapsed_s": elapsed,
            "tokens_per_s": streams * tokens / elapsed, "wrong_text": wrong_text, "wrong_usage": wrong_usage,
            "usage_mismatches": mismatches, "chunks": chunks, "tokens": streams * tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    sglang.configure(version="0.5.23", coalesce=(1, 4, 2, 3))
    settings = Settings(engine="sglang", model_path="/models/fake", max_concurrent_generations=args.streams + 16)
    port = free_port()
    app = create_app(settings, SGLangEngine(settings.engine_config()))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    try:
        report = asyncio.run(drive(url, args.streams, args.tokens))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if report["wrong_text"] or report["wrong_usage"] or report["usage_mismatches"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
