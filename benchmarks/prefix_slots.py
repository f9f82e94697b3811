"""Prefix-aware context choice in the CPU engine: repeated-prefix requests with and without it.

The CPU engine keeps one llama.cpp context per concurrent generation; a request reuses the KV cache of the context
it lands in as far as its prompt shares a prefix with what that context last held. With prefix choice
(engine/slots.py) it lands in the free context holding the longest prefix of its prompt; the baseline, in the same
invocation, takes the context free the longest (what it did before). The load: `--systems` system prompts of about
`--system-tokens` tokens each, `--requests` requests each naming one of them at random (seeded) and a short
question, `--concurrency` at a time on `--slots` contexts, `--tokens` generated each. Reported per mode: the share
of prompt tokens taken from the cache, and time to first token p50/p99; the ratios are prefix over baseline.

    python benchmarks/prefix_slots.py [--slots 4] [--systems 3] [--requests 48] [--concurrency 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import relay
from tally_runtime.engine.base import GenerationRequest, SamplingParams
from tally_runtime.engine.llamacpp import LlamaCppEngine, embedded_model_path

TOPICS = ["a shipping company's parcels", "home cooking and recipes", "a city's public transport",
          "houseplants and their care", "personal budgeting", "bicycle repair", "a public library's loans"]


def system_prompt(topic: str, tokens: int) -> str:
    sentence = f"You are a careful assistant for {topic}. Answer briefly, politely and only about {topic}. "
    return sentence * max(1, tokens // 20)


async def measure(by_prefix: bool, args: argparse.Namespace) -> dict[str, Any]:
    engine = LlamaCppEngine(embedded_model_path(), context_length=1024, slots=args.slots, threads=0,
                            by_prefix=by_prefix)
    await engine.start()
    rng = random.Random(args.seed)
    systems = [system_prompt(TOPICS[i % len(TOPICS)], args.system_tokens) for i in range(args.systems)]
    jobs = [(rng.choice(systems), f"Question {i}: what should I do first?") for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(args.concurrency)  # the runtime's admission: at most this many at once
    prompt_total = cached_total = 0
    ttfts: list[float] = []

    async def one(index: int, system: str, question: str) -> None:
        nonlocal prompt_total, cached_total
        async with gate:
            prompt = engine.tokenize(system + question)
            started = time.perf_counter()
            first = None
            async for delta in engine.generate(GenerationRequest(f"b{index}.", prompt, params)):
                if first is None and delta.completion_tokens:
                    first = time.perf_counter() - started
                if delta.finish_reason is not None:
                    prompt_total += delta.prompt_tokens or 0
                    cached_total += delta.cached_tokens or 0
            ttfts.append(first if first is not None else float("nan"))

    try:
        started = time.perf_counter()
        await asyncio.gather(*(one(i, s, q) for i, (s, q) in enumerate(jobs)))
        wall = time.perf_counter() - started
    finally:
        await engine.stop()
    ttfts.sort()
    return {"cached_share": cached_total / max(1, prompt_total), "prompt_tokens": prompt_total,
            "cached_tokens": cached_total, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))], "wall_s": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"prefix": [], "baseline": []}
    for r in range(args.repeats):
        for kind in (("prefix", "baseline") if r % 2 == 0 else ("baseline", "prefix")):  # neither always first
            runs[kind].append(asyncio.run(measure(kind == "prefix", args)))
    median = {kind: sorted(v, key=lambda x: x["ttft_p50_s"])[len(v) // 2] for kind, v in runs.items()}
    return {"args": vars(args), "runs": runs, "median": median,
            "ttft_p50_ratio": relay.ratio(median["prefix"]["ttft_p50_s"], median["baseline"]["ttft_p50_s"]),
            "ttft_p99_ratio": relay.ratio(median["prefix"]["ttft_p99_s"], median["baseline"]["ttft_p99_s"]),
            "wall_ratio": relay.ratio(median["prefix"]["wall_s"], median["baseline"]["wall_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--systems", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=62)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = run(args)
    for kind, r in report["median"].items():
        print(f"{kind:>9}: {r['cached_share']:.1%} of {r['prompt_tokens']} prompt tokens cached, TTFT p50 "
              f"{r['ttft_p50_s'] * 1000:.0f} ms p99 {r['ttft_p99_s'] * 1000:.0f} ms, {r['wall_s']:.1f} s in all")
    print(f"prefix choice vs baseline: TTFT p50 {report['ttft_p50_ratio']:.2f}x, p99 {report['ttft_p99_ratio']:.2f}x, "
          f"wall {report['wall_ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
