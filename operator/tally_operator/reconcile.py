"""One reconcile pass for one CompletionService: apply the children, read them back, scrape usage, write status.

Everything a pass needs comes in explicitly: the `Context` built once at start-up (settings, API client,
metrics) and the resource's own `ServiceMemory`. Passes run on kopf's event loop; blocking API calls go
through a thread, the scrape is awaited directly. Errors are domain errors here (`KubeError`,
`SpecError`); handlers.py maps the transient ones to kopf's retry.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from tally_operator import constants as c
from tally_operator.conditions import Verdict, is_bad, transitions
from tally_operator.desired import desired_deployment, desired_pdb, desired_service, endpoint
from tally_operator.kube import Kube, KubeError
from tally_operator.metrics import OperatorMetrics
from tally_operator.samples import MetricsParseError, parse_sample
from tally_operator.scrape import scrape
from tally_operator.settings import OperatorSettings
from tally_operator.spec import Spec, SpecError, parse_spec
from tally_operator.status import build_status, invalid_verdicts, observed_fields, without_times, workload_verdicts
from tally_operator.usage import Round, UsageState, absorb, scrape_targets, state_from_status, usage_status
from tally_operator.verdict import judge

log = logging.getLogger("tally_operator")
MEMO_SECONDS = 10.0  # how long our own last write outranks a possibly stale body


@dataclass
class Context:
    """What every pass shares, built once when the operator starts."""

    settings: OperatorSettings
    kube: Kube
    metrics: OperatorMetrics


@dataclass
class ServiceMemory:
    """What this process remembers about one CompletionService between passes."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one pass at a time per resource
    scraped_at: float = -1e9  # monotonic time of the last scrape round
    usage: UsageState | None = None  # None until the first round in this process resumes from the status
    written: tuple[float, dict[str, Any]] | None = None  # (monotonic time, status) of our last write
    apply_error: SpecError | None = None  # the API server's refusal, until a pass applies cleanly


async def reconcile(ctx: Context, body: kopf.Body, patch: kopf.Patch, memory: ServiceMemory,
                    apply_children: bool) -> None:
    """One pass. Passes of the same resource (timers, events) run one at a time, so an older reading of
    the children can never overwrite a newer status."""
    async with memory.lock:
        await _reconcile(ctx, body, patch, memory, apply_children)


async def _reconcile(ctx: Context, body: kopf.Body, patch: kopf.Patch, memory: ServiceMemory,
                     apply_children: bool) -> None:
    meta = {"name": body.meta["name"], "namespace": body.meta["namespace"], "uid": body.meta["uid"]}
    generation = int(body.meta.get("generation") or 0)
    previous = dict(body.get("status") or {})
    here = {"endpoint": endpoint(meta, ctx.settings)}
    try:
        spec = parse_spec(body.spec)
    except SpecError as error:
        write_status(body, patch, memory, previous, build_status(previous, invalid_verdicts(error), now(),
                                                                 generation, here))
        return
    try:
        if apply_children:
            await asyncio.to_thread(apply_all, ctx, meta, spec)
            memory.apply_error = None
        deployment = await asyncio.to_thread(ctx.kube.get, "apps/v1", "Deployment", meta["name"], meta["namespace"])
        pods = await asyncio.to_thread(ctx.kube.pods, meta["namespace"], f"{c.LABEL_SERVICE}={meta['name']}")
    except KubeError as error:
        if error.transient:
            raise
        memory.apply_error = rejected(error)
        deployment, pods = None, []
    if memory.apply_error is not None:  # until a pass applies cleanly, the rejection is the news
        write_status(body, patch, memory, previous, build_status(previous, invalid_verdicts(memory.apply_error),
                                                                 now(), generation, here))
        return
    fields = observed_fields(meta["name"], deployment, here["endpoint"])
    verdicts = workload_verdicts(spec, deployment, pods)
    checked = await check_usage(ctx, meta, spec, pods, memory, previous)
    if checked is not None:
        fields["usage"], usage_verdict, unaccounted = checked
        verdicts.append(usage_verdict)
        if unaccounted:
            kopf.event(body, type="Warning", reason="UsageUnaccounted",
                       message=f"{unaccounted} pod(s) went away or restarted their counters before their last "
                               "counters were read: what they served since the scrape before is not in the totals")
    write_status(body, patch, memory, previous, build_status(previous, verdicts, now(), generation, fields))


async def check_usage(ctx: Context, meta: dict[str, str], spec: Spec, pods: list[dict[str, Any]],
                      memory: ServiceMemory, previous: dict[str, Any]) -> tuple[dict[str, object], Verdict, int] | None:
    """Scrape the service's pods when its scrape interval is due; None when it is not.

    Returns the new `status.usage`, the UsageHealthy verdict and how many pods this round found
    unaccounted. The readings the totals stand on go into the same status write, so a restarted
    operator continues from exactly there."""
    if time.monotonic() - memory.scraped_at < spec.scrape_interval_seconds:
        return None
    memory.scraped_at = time.monotonic()
    if memory.usage is None:  # first round in this process: continue from the status
        memory.usage = state_from_status(previous.get("usage") or {})
    state = memory.usage
    targets = scrape_targets(pods, state.readings, c.RUNTIME_PORT)
    results = await scrape(targets, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout)
    samples, failed = {}, set()
    for uid, result in results.items():
        try:
            if isinstance(result, Exception):
                raise result
            samples[uid] = parse_sample(result)
        except (Exception, MetricsParseError) as err:  # one pod's failure is that pod's alone
            failed.add(uid)
            log.info("Scraping pod %s of %s/%s failed: %s", uid, meta["namespace"], meta["name"], err)
    round_ = Round(samples, frozenset(failed), present=frozenset(p["metadata"]["uid"] for p in pods))
    unaccounted = state.unaccounted
    increase = absorb(state, round_)
    verdict = judge(state, round_, spec.max_mismatch_ratio)
    ctx.metrics.record(meta["namespace"], meta["name"], increase, verdict.status, len(samples), len(failed),
                       state.unaccounted - unaccounted, state.tenant_increase)
    return usage_status(state, round_, now()), verdict, state.unaccounted - unaccounted


def rejected(error: KubeError) -> SpecError:
    """A non-transient API refusal: our RBAC (403) or a child the server finds invalid (400/422)."""
    reason = "Forbidden" if error.status == 403 else "InvalidChild"
    return SpecError(reason, f"The API server refused a child object: {error.message}")


def apply_all(ctx: Context, meta: dict[str, str], spec: Spec) -> None:
    ctx.kube.apply(desired_deployment(meta, spec, ctx.settings))
    ctx.kube.apply(desired_service(meta))
    pdb = desired_pdb(meta, spec)
    if pdb is not None:
        ctx.kube.apply(pdb)
    else:
        ctx.kube.delete("policy/v1", "PodDisruptionBudget", meta["name"], meta["namespace"])


def write_status(body: kopf.Body, patch: kopf.Patch, memory: ServiceMemory, previous: dict[str, Any],
                 status: dict[str, Any]) -> None:
    """Write only on change; post an Event for every condition that flipped.

    The memory holds what this process last wrote, so a timer racing an event handler over the same
    stale body does not write (or announce) the same transition twice.
    """
    fresh = memory.written is not None and time.monotonic() - memory.written[0] < MEMO_SECONDS
    known = memory.written[1] if fresh and memory.written is not None else previous
    if without_times(status) == without_times(known):
        return
    memory.written = (time.monotonic(), status)
    patch.status.update(status)
    for condition in transitions(known.get("conditions") or [], status["conditions"]):
        kopf.event(body, type="Warning" if is_bad(condition) else "Normal",
                   reason=f"{condition['type']}{condition['status']}"[:128],
                   message=f"{condition['reason']}: {condition['message']}"[:1024])


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
