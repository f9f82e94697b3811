"""Budgets clients never retry: what a tenant's requests see when its budget is smaller than their demand.

Two runtimes, each in its own process (relay.py's `tally-budgets` app over its model-free engine, a token every
`--token-seconds`, so requests overlap as on a real node), and the operator's real budget planner between them:
every round reads both runtimes' /metrics, books them (`usage.book`), plans (`budget.plan_budgets`) and posts
the lease messages back, at once when a runtime's long-poll says a request waits, at most twice a second, as
the operator's `budget_asks` daemon does (handlers.py), else every second.

The real `openai` SDK at its defaults (max_retries=2) sends `--requests` concurrent completions of one tenant
(`--max-tokens` each, with `ignore_eos`: every request bills its reservation), split across both runtimes, with
a budget of `--budget` tokens, less than they ask for together. Measured: attempts per request (every retry the
SDK sent counted), the share of the budget used, the codes of the refusals, and time-to-serve p50/p99 of the
requests served. The baseline, in the same invocation, is the same load with no budget for the tenant (never
held): the ratio says what waiting for allowance costs the requests that are served.

    python benchmarks/budget_waits.py [--requests 100] [--budget 2000] [--max-tokens 24] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
import relay
from tally_operator.budget import (
    BudgetConfig,
    LeaseReport,
    TenantBudget,
    budgets_status,
    plan_budgets,
    state_from_status,
)
from tally_operator.samples import parse_sample
from tally_operator.usage import Round, book, ledger_from_status, ledger_status
from tally_runtime.contract import BUDGET_ASKS_PATH, BUDGETS_PATH

TENANT = "acme"
PACE_SECONDS = 0.5  # handlers.ASKS_PACE_SECONDS: at most two rounds a second while requests wait
SCRAPE_SECONDS = 1.0  # the rounds when nobody asks (a service's usageHealth.scrapeIntervalSeconds)


class Planner:
    """The operator's budget rounds over the runtimes at `ports`, with its books kept as JSON as the status
    keeps them (every round reads them back)."""

    def __init__(self, ports: list[int], budget: int | None) -> None:
        self.ports = {f"pod-{i}": port for i, port in enumerate(ports)}
        limit = TenantBudget(monthly_tokens=budget) if budget is not None else None
        # No budget: the tenant is listed with none, so the pods admit it freely (the baseline)
        self.config = BudgetConfig("total", None, {TENANT: limit} if limit else {})
        self.usage: dict[str, Any] = {}
        self.budgets: dict[str, Any] = {}
        self.rounds = 0
        self.landed = asyncio.Event()  # set after each round (replaced by a new one)

    async def round(self, http: httpx.AsyncClient) -> None:
        texts = await asyncio.gather(*(http.get(f"http://127.0.0.1:{port}/metrics") for port in self.ports.values()))
        samples = {uid: parse_sample(text.text) for uid, text in zip(self.ports, texts, strict=True)}
        before = ledger_from_status(self.usage)
        booking = book(before, Round(samples, present=frozenset(samples)))
        planned = plan_budgets(self.config, before, booking.ledger, state_from_status(self.budgets),
                               frozenset(samples), datetime.datetime.now(datetime.UTC),
                               {uid: s.wanted for uid, s in samples.items() if s.wanted},
                               {uid: LeaseReport(s.lease_seq, s.reach) for uid, s in samples.items() if s.lease_seq})
        self.usage = json.loads(json.dumps(ledger_status(booking.ledger)))
        self.budgets = json.loads(json.dumps(budgets_status(planned, self.config)))
        for uid, message in planned.messages.items():
            await http.post(f"http://127.0.0.1:{self.ports[uid]}{BUDGETS_PATH}", content=json.dumps(message))
        self.rounds += 1
        self.landed.set()
        self.landed = asyncio.Event()

    async def caught_up(self, tokens: int, seconds: float) -> None:
        """Until the books hold `tokens` (the last requests' usage), round by round, for at most `seconds`."""
        deadline = time.monotonic() + seconds
        while self.spent() != tokens and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.landed.wait(), max(0.0, deadline - time.monotonic()))

    def spent(self) -> int:
        tenant = (self.budgets.get("tenants") or {}).get(TENANT) or {}
        return int(tenant.get("spent", 0))

    async def asked(self, http: httpx.AsyncClient) -> None:
        """Until a runtime says a request waits, or a scrape's interval passed."""
        polls = [asyncio.create_task(http.get(f"http://127.0.0.1:{port}{BUDGET_ASKS_PATH}?wait={SCRAPE_SECONDS}"))
                 for port in self.ports.values()]
        try:
            for done in asyncio.as_completed(polls):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    answer = (await done).json()
                    if answer.get("waiting") or answer.get("leased") is False:
                        return
        finally:
            for poll in polls:
                poll.cancel()

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                await self.round(http)
                await self.asked(http)
                await asyncio.sleep(PACE_SECONDS)


async def load(ports: list[int], requests: int, max_tokens: int) -> dict[str, Any]:
    """`requests` concurrent completions from the SDK at its defaults, alternating between the runtimes."""
    attempts = 0

    async def count(_: httpx.Request) -> None:
        nonlocal attempts
        attempts += 1

    async def one(port: int) -> tuple[float, int, str]:
        started = time.monotonic()
        async with httpx.AsyncClient(event_hooks={"request": [count]}, timeout=120) as http:
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", http_client=http,
                                     default_headers={"X-Tally-Tenant": TENANT})
            try:
                reply = await sdk.completions.create(model="m", prompt="Tell me a joke", max_tokens=max_tokens,
                                                     extra_body={"ignore_eos": True})
            except openai.APIStatusError as error:
                body = error.body if isinstance(error.body, dict) else {}
                return time.monotonic() - started, 0, f"{error.status_code} {body.get('code') or error.message}"
            except openai.APIConnectionError as error:
                return time.monotonic() - started, 0, f"connection {error}"
        assert reply.usage is not None
        return time.monotonic() - started, reply.usage.total_tokens, ""

    answers = await asyncio.gather(*(one(ports[i % len(ports)]) for i in range(requests)))
    served = sorted(seconds for seconds, _, error in answers if not error)
    refusals: dict[str, int] = {}
    for _, _, error in answers:
        if error:
            refusals[error] = refusals.get(error, 0) + 1
    return {"attempts_per_request": attempts / requests, "served": len(served),
            "tokens": sum(tokens for _, tokens, _ in answers), "refusals": refusals,
            "serve_p50_s": percentile(served, 0.5), "serve_p99_s": percentile(served, 0.99)}


def percentile(values: list[float], share: float) -> float:
    return values[min(len(values) - 1, int(len(values) * share))] if values else float("nan")


async def measure(budget: int | None, requests: int, max_tokens: int) -> dict[str, Any]:
    """One run on fresh runtimes (their counters begin at zero)."""
    servers = [relay.start_server("tally-budgets", "uvloop") for _ in range(2)]
    try:
        planner = Planner([port for _, port in servers], budget)
        stop = asyncio.Event()
        rounds = asyncio.create_task(planner.run(stop))
        result = await load([port for _, port in servers], requests, max_tokens)
        if budget is not None:
            await planner.caught_up(result["tokens"], 30)
        stop.set()
        await rounds
        result["booked"] = planner.spent() if budget is not None else result["tokens"]
        result["rounds"] = planner.rounds
        if budget is not None:
            result["usable"] = result["tokens"] / budget
        return result
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)


def run(requests: int, budget: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"budget": [], "baseline": []}
    for r in range(repeats):
        for kind in (("budget", "baseline") if r % 2 == 0 else ("baseline", "budget")):  # neither always first
            runs[kind].append(asyncio.run(measure(budget if kind == "budget" else None, requests, max_tokens)))
    median = {kind: sorted(v, key=lambda x: x["serve_p50_s"])[len(v) // 2] for kind, v in runs.items()}
    return {"requests": requests, "budget": budget, "max_tokens": max_tokens, "repeats": repeats,
            "token_seconds": float(os.environ.get("TALLY_BENCH_TOKEN_SECONDS", "0")), "runs": runs,
            "median": median,
            "serve_p50_ratio": relay.ratio(median["budget"]["serve_p50_s"], median["baseline"]["serve_p50_s"]),
            "serve_p99_ratio": relay.ratio(median["budget"]["serve_p99_s"], median["baseline"]["serve_p99_s"]),
            "worst_usable": min(x["usable"] for x in runs["budget"]),
            "worst_attempts_per_request": max(x["attempts_per_request"] for x in runs["budget"]),
            "overshoot": max(x["tokens"] - budget for x in runs["budget"]),
            "books_exact": all(x["booked"] == x["tokens"] for x in runs["budget"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--token-seconds", type=float, default=0.02, help="the engine's time per token")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ["TALLY_BENCH_TOKEN_SECONDS"] = str(args.token_seconds)  # the runtimes' engine (relay.py)
    report = run(args.requests, args.budget, args.max_tokens, args.repeats)
    for kind, r in report["median"].items():
        print(f"{kind:>9}: {r['attempts_per_request']:.2f} attempts/request, {r['served']} served, {r['tokens']} "
              f"tokens, serve p50 {r['serve_p50_s']:.2f} s p99 {r['serve_p99_s']:.2f} s, refusals {r['refusals']}")
    print(f"usable (worst run) {report['worst_usable']:.1%}, attempts/request (worst) "
          f"{report['worst_attempts_per_request']:.2f}, overshoot {report['overshoot']}, books exact "
          f"{report['books_exact']}; serve p50 {report['serve_p50_ratio']:.2f}x, p99 {report['serve_p99_ratio']:.2f}x "
          "the baseline")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
