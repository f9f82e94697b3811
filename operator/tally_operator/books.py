"""I/O: the books: scrape a service's pods, book the round into the ledger persisted in its status and its
UsageShards, and write them by compare-and-swap on the resourceVersions the pass planned against
(bookkeeping.py plans, purely).

The pods are scraped after the status they are booked into was read, and a refused write re-reads the object and
scrapes again: so every sample booked is newer than every reading in the ledger it is booked into, and two passes
on one stale body, or a peer that resumes after another wrote, can never regress `status.usage`, book a stale
sample or book a round twice. Only once the write has landed does the pass count the round on the operator's
/metrics, post its Events, send the budgets' leases and acknowledge the final counters of drained pods (their
runtimes then exit)."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import kopf

from tally_operator import constants as c
from tally_operator.bookkeeping import Observed, Plan, plan
from tally_operator.collector import collect
from tally_operator.conditions import is_bad
from tally_operator.context import Context, Scraped, ServiceMemory
from tally_operator.kube import KubeError
from tally_operator.samples import MetricsParseError, PodSample, parse_sample
from tally_operator.scrape import Call, post_all, scrape
from tally_operator.shard_store import ShardNameTaken, read_shards, write_shard
from tally_operator.shards import MAX_SHARD_TENANTS
from tally_operator.signing import Signer
from tally_operator.usage import (
    Round,
    counted_uids,
    ledger_from_status,
    scrape_targets,
)
from tally_runtime.contract import BUDGETS_PATH, FINAL_READ_PATH, FINAL_READ_SIGNATURE_HEADER

log = logging.getLogger("tally_operator")


MAX_WRITES = 5  # compare-and-swap attempts per pass before kopf retries the pass

Observe = Callable[[Mapping[str, Any]], Awaitable[tuple[Observed, "Scraped | None"]]]

def fixed(observed: Observed) -> Observe:
    """Observations that do not depend on the status they are written against (nothing scraped)."""
    async def observe(_: Mapping[str, Any]) -> tuple[Observed, Scraped | None]:
        return observed, None

    return observe

def scrape_due(memory: ServiceMemory, interval: float) -> bool:
    if time.monotonic() - memory.scraped_at < interval and not memory.scrape_now:
        return False
    memory.scraped_at, memory.scrape_now = time.monotonic(), False
    return True

async def scrape_round(ctx: Context, meta: Mapping[str, str], pods: list[dict[str, Any]],
                       obj: Mapping[str, Any]) -> Scraped:
    """Read every pod the ledger counts or should count; each pod's failure is that pod's alone."""
    readings = ledger_from_status((obj.get("status") or {}).get("usage") or {}).readings
    targets = scrape_targets(pods, readings, c.RUNTIME_METRICS_PORT)
    results = await scrape(targets, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
    samples: dict[str, PodSample] = {}
    failed: set[str] = set()
    refused: dict[str, str] = {}
    for uid, result in results.items():
        try:
            if isinstance(result, Exception):
                raise result
            samples[uid] = await parse(result, uid)
        except MetricsParseError as err:
            failed.add(uid)
            refused[uid] = str(err)
        except Exception as err:
            failed.add(uid)
            log.info("Scraping pod %s of %s/%s failed: %r", uid, meta["namespace"], meta["name"], err)
    urls = {uid: url.removesuffix("/metrics") for uid, url in targets.items()}
    return Scraped(Round(samples, frozenset(failed), present=counted_uids(pods)), urls, refused)

PARSE_ON_LOOP_BYTES = 64 << 10  # larger bodies are parsed in a thread: kopf's loop keeps serving meanwhile

async def parse(text: str, uid: str) -> PodSample:
    if len(text) <= PARSE_ON_LOOP_BYTES:
        return parse_sample(text, expected_pod_uid=uid)
    return await asyncio.to_thread(parse_sample, text, uid)

async def commit(ctx: Context, body: kopf.Body, memory: ServiceMemory, obj: Mapping[str, Any],
                 observe: Observe, books: bool = True) -> Scraped | None:
    """Observe against `obj`'s status and the service's UsageShards (scraping after both were read), plan, and
    write the shards that changed, then the status, each by compare-and-swap; a refused write reads everything
    again and observes again. Then what may only follow a landed write. `books`: whether the pass may scrape
    (the shards are read only then). Returns the round whose status landed (None: nothing was scraped, or the
    object is gone)."""
    meta = obj["metadata"]
    if books:  # books are planned on the status as it is now, not on a body kopf handed over a while ago
        fresh = await asyncio.to_thread(ctx.kube.get, c.API_VERSION, c.KIND, meta["name"], meta["namespace"])
        if fresh is None or fresh["metadata"]["uid"] != meta["uid"]:
            return None
        obj, meta = fresh, fresh["metadata"]
    blocked: frozenset[int] = frozenset()
    for _ in range(MAX_WRITES):
        shards = await asyncio.to_thread(read_shards, ctx.kube, meta) if books else {}
        observed, scraped = await observe(obj)
        if observed.round is not None:
            # The shards' hash key, for a ledger that has none yet (the status keeps it from then): every operator
            # holding the chart's signing key derives the same, so two that move one ledger at once agree
            key = ctx.signer.derived_key(f"usage-shards/{meta['uid']}")
            observed = replace(observed, shards=shards, shard_key=key, blocked=blocked)
        # Pure, and seconds at 10,000 tenants: off kopf's loop, which serves every other service meanwhile
        planned = await asyncio.to_thread(plan, obj.get("status") or {}, memory.observations, observed, now())
        if not planned.changed and not planned.shards:
            memory.observations = planned.observations
            if planned.booking is not None:  # a round that booked nothing new: the status as persisted holds it
                await landed(ctx, body, memory, planned, scraped)
            return scraped
        try:
            for index, shard_body in sorted(planned.shards.items()):
                await asyncio.to_thread(write_shard, ctx.kube, meta, index, shard_body, shards.get(index))
            await asyncio.to_thread(ctx.kube.replace_status, c.API_VERSION, c.KIND, meta["name"],
                                    meta["namespace"], planned.status, str(meta["resourceVersion"]))
        except ShardNameTaken as taken:  # planned again without what would be written there (pods wait)
            log.warning("Not writing a shard of %s/%s: %s", meta["namespace"], meta["name"], taken)
            ctx.post_event(body, "Warning", "UsageShardNameTaken", f"{taken}: the pods whose tenants are booked there "
                                                                   "wait for a later round")
            blocked |= {index}
            continue
        except KubeError as error:
            if not error.conflict:
                raise
            fresh = await asyncio.to_thread(ctx.kube.get, c.API_VERSION, c.KIND, meta["name"], meta["namespace"])
            if fresh is None or fresh["metadata"]["uid"] != meta["uid"]:
                return None  # deleted (or deleted and created again) meanwhile: nothing of ours to write
            obj, meta = fresh, fresh["metadata"]
            continue
        await landed(ctx, body, memory, planned, scraped)
        return scraped
    raise KubeError(409, f"the status changed under {MAX_WRITES} writes in a row")

async def landed(ctx: Context, body: kopf.Body, memory: ServiceMemory, planned: Plan, scraped: Scraped | None) -> None:
    memory.observations = planned.observations
    meta = body.meta
    post = ctx.post_event
    for condition in planned.transitions:
        post(body, "Warning" if is_bad(condition) else "Normal", f"{condition['type']}{condition['status']}",
             f"{condition['reason']}: {condition['message']}")
    if scraped is None or planned.booking is None:
        return
    for uid, reason in scraped.refused.items():  # once per pod and reason, not every round
        if memory.refused.get(uid) != reason:
            log.warning("Refusing the metrics of pod %s of %s/%s: %s", uid, meta["namespace"], meta["name"], reason)
            post(body, "Warning", "MetricsRefused", f"The /metrics of pod {uid} were not counted: {reason}")
    memory.refused = dict(scraped.refused)
    for uid, reason in planned.left_out.items():  # once per pod and reason, as for refused metrics
        if memory.left_out.get(uid) != reason:
            log.warning("Leaving the round of pod %s of %s/%s for later: %s", uid, meta["namespace"], meta["name"],
                        reason)
            post(body, "Warning", "UsageRoundDeferred", f"Pod {uid} was not booked this round: {reason}")
    memory.left_out = dict(planned.left_out)
    for uid, sample in scraped.round.samples.items():  # records a pod could not deliver: once per increase
        before = memory.records_lost.get(uid)
        if before is not None and sample.records_lost > before:
            post(body, "Warning", "UsageRecordsLost",
                 f"Pod {uid} could not deliver {sample.records_lost - before} usage record(s) to the billing system "
                 f"({sample.records_lost} in all): its spool was full (the receiver down or too slow) or it drained "
                 "with records undelivered; the ledger (status.usage) still counts them")
    memory.records_lost = {uid: s.records_lost for uid, s in scraped.round.samples.items()}
    booking = planned.booking
    if booking.lost:
        post(body, "Warning", "UsageUnaccounted",
             f"{booking.lost} pod(s) went away or restarted their counters before their last counters were read: "
             "what they served since the scrape before is not in the totals")
    ctx.metrics.record(meta["namespace"], meta["name"], planned.ledger or booking.ledger,
                       planned.verdict.status if planned.verdict else "Unknown", len(scraped.round.samples),
                       len(scraped.round.failed), created_at(meta))
    if booking.folded:
        post(body, "Warning", "TenantsFolded", f"{booking.folded} tenant(s) whose part of the books (a UsageShard "
                                               f"of {MAX_SHARD_TENANTS} tenants) was full were booked to tenant "
                                               "'other' (the totals are unaffected)")
    if planned.budgets is not None:
        pending = planned.budgets.pending_count
        if pending and memory.budget_notice != pending:
            post(body, "Warning", "BudgetCountDeferred",
                 f"spec.budgets.count is {pending}, but {planned.budgets.state.period} is counted in "
                 f"{planned.budgets.state.count}: the month's spend cannot be carried into another count, so the "
                 f"change applies from the next month")
        memory.budget_notice = pending
        for tenant, mark in planned.budgets.crossed:
            post(body, "Warning" if mark >= 1 else "Normal", "BudgetExhausted" if mark >= 1 else "BudgetWarning",
                 f"Tenant {tenant} has spent {mark:.0%} of its budget for {planned.budgets.state.period}")
        refusals: dict[str, float] = {}
        for sample in scraped.round.samples.values():
            for tenant, refused in sample.refusals.items():
                refusals[tenant] = refusals.get(tenant, 0.0) + refused
        ctx.metrics.budgets(meta["namespace"], meta["name"], planned.budgets.tenants, refusals)
        await send_leases(ctx, scraped, planned.budgets.messages)
        source = planned.budgets.source
        if source.startswith("Budget/") and any(view.asked for view in planned.budgets.tenants.values()):
            ctx.wake(("Budget", source.removeprefix("Budget/")))  # requests wait for more than this slice
    if ctx.forwarder is not None:  # the records of what was just booked, to the platform's billing system
        await collect(ctx.forwarder, ctx.signer, ctx.settings.scrape_timeout, meta, scraped.urls)
    await acknowledge_final(ctx, scraped)

async def send_leases(ctx: Context, scraped: Scraped, messages: Mapping[str, Mapping[str, Any]]) -> None:
    """Tell each serving pod its leases (written into the status first: a restarted operator knows them)."""
    calls = {uid: signed(ctx.signer, scraped.urls[uid] + BUDGETS_PATH, message)
             for uid, message in messages.items() if uid in scraped.urls}
    if calls:
        results = await post_all(calls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
        for uid, result in results.items():
            if result != 200:
                log.info("The leases for pod %s were not taken: %r", uid, result)

async def acknowledge_final(ctx: Context, scraped: Scraped) -> None:
    """Tell each drained pod that its final counters are booked: only that lets its runtime exit."""
    calls = {uid: signed(ctx.signer, scraped.urls[uid] + FINAL_READ_PATH, {**sample.acknowledgement(), "podUid": uid})
             for uid, sample in scraped.round.samples.items() if sample.final and uid in scraped.urls}
    if calls:
        results = await post_all(calls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
        for uid, result in results.items():
            if result != 200:
                log.info("The final-read acknowledgement to pod %s was not taken: %r", uid, result)

def signed(signer: Signer, url: str, body: Mapping[str, Any]) -> Call:
    """A final-read call, signed over its exact bytes (tally_runtime/handoff.py)."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return url, raw, {FINAL_READ_SIGNATURE_HEADER: signer.sign(raw)}

def created_at(meta: Mapping[str, Any]) -> float | None:
    """The object's creationTimestamp in unix seconds (None when it is missing or malformed)."""
    try:
        return datetime.datetime.strptime(str(meta["creationTimestamp"]), "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.UTC).timestamp()
    except (KeyError, ValueError):
        return None

def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
