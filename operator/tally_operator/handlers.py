"""The only module with kopf decorators. Each handler hands its resource to `reconcile` in a line or two.

Level-triggered: create, update, resume and a periodic timer all run the same reconcile, which never
branches on the event type. A second, faster timer only refreshes status from the children. The timers'
intervals are kopf decorator arguments, so the settings are read when this module is imported; everything
else a pass needs is the `Context` built at start-up and kept in kopf's operator memo.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf

from tally_operator import constants as c
from tally_operator.asks import asked
from tally_operator.budget_round import budget_round
from tally_operator.budget_shards import joined_status, owned
from tally_operator.collector import Forwarder
from tally_operator.context import Context, ServiceMemory
from tally_operator.kube import Kube, KubeError
from tally_operator.metrics import OperatorMetrics
from tally_operator.platform import BudgetSpecError, PlatformBudget, parse_budget
from tally_operator.reconcile import reconcile
from tally_operator.release import release_pods
from tally_operator.scaling import held_now
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer
from tally_operator.spec import SpecError

SETTINGS = OperatorSettings.from_env()
RETRY_SECONDS = 10
RELEASE_TRIES = 30  # about a minute of releasing a deleted service's pods as they start to drain
ACTIVATION_POLL_SECONDS = 25  # the activator long-poll's length (it returns at once when something is held)
ASKS_POLL_SECONDS = 25  # the budget asks long-poll's length (it returns at once when a request waits)
ASKS_PACE_SECONDS = 0.5  # at most two rounds a second while requests wait for allowance
BUDGET_ROUND_SECONDS = 5.0  # a Budget's rounds when no service asks for more


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own bookkeeping goes to annotations, so the status schema can stay strict.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=c.GROUP)
    settings.posting.level = logging.WARNING
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]
    settings.watching.server_timeout = 120
    # Blocking API calls run in kopf's thread pool; on 2 cores its default size did better than 32
    # threads (benchmarks/README.md); larger machines may raise it.
    if SETTINGS.workers:
        settings.execution.max_workers = SETTINGS.workers
    settings.peering.name = SETTINGS.peering_name
    settings.peering.clusterwide = SETTINGS.peering_clusterwide
    signer = Signer.load(SETTINGS.signing_key_file)
    memo.context = Context(replace(SETTINGS, final_read_key=signer.public_key), Kube(), OperatorMetrics(), signer,
                           forwarder=Forwarder(SETTINGS) if SETTINGS.records_url else None)
    if SETTINGS.metrics_port:
        memo.context.metrics.serve(SETTINGS.metrics_port, SETTINGS.metrics_address)


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
async def forget(name: str, namespace: str | None, uid: str, memo: kopf.Memo, retry: int, **_: Any) -> None:
    memo.context.metrics.forget(namespace or "", name)
    try:
        waiting = await release_pods(memo.context, {"name": name, "namespace": namespace or "", "uid": uid})
    except KubeError as error:  # the pods then wait out their final read: nothing is lost but time
        logging.getLogger("tally_operator").info("Could not release the pods of %s/%s: %s", namespace, name, error)
        return
    if waiting and retry < RELEASE_TRIES:  # a deleted pod drains after its preStop pause: try again shortly
        raise kopf.TemporaryError(f"{waiting} pod(s) of {namespace}/{name} not draining yet", delay=2)


@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL)
async def on_change(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    await run(body, memo, apply_children=True, platform=platform(kwargs))


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=SETTINGS.reconcile_interval, initial_delay=5)
async def periodic_reconcile(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    await run(body, memo, apply_children=True, platform=platform(kwargs))


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=SETTINGS.status_interval, idle=0)
async def refresh_status(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    await run(body, memo, apply_children=False, platform=platform(kwargs))


def scales_to_zero(spec: kopf.Spec, **_: Any) -> bool:
    scaling = spec.get("autoscaling") or {}
    return bool(scaling) and bool(scaling.get("enabled", True)) and scaling.get("minReplicas", 1) == 0


@kopf.daemon(c.GROUP, c.VERSION, c.PLURAL, when=scales_to_zero, cancellation_timeout=5)
async def activation(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    """With scale to zero: long-poll the activator, and run a pass as soon as it holds a request (which
    starts a pod at zero, and points the Service back at the pods once one is ready), then every second
    while anything is held."""
    meta = {"name": body.meta["name"], "namespace": body.meta["namespace"], "uid": body.meta["uid"]}
    while not stopped:
        try:
            held = await held_now(memo.context, meta, wait=ACTIVATION_POLL_SECONDS)
            if held.requests:
                await run(body, memo, apply_children=False, platform=platform(kwargs))
        except (KubeError, kopf.TemporaryError) as error:
            logging.getLogger("tally_operator").info("Activation check of %s/%s failed: %s", meta["namespace"],
                                                     meta["name"], error)
        await stopped.wait(1.0)  # paces the loop: a long-poll with something held answers at once


@kopf.index(c.GROUP, c.VERSION, c.BUDGET_PLURAL)
def budget_index(body: kopf.Body, name: str, memo: kopf.Memo, **_: Any) -> dict[str, dict[str, Any]]:
    """The cluster's Budgets as the API server last told (kopf starts no handler before this is filled): every
    pass reads which one covers its service from here, not from the API server. An edited spec wakes the
    Budget's round."""
    context: Context | None = memo.get("context")
    if context is not None:
        context.budget_edited(name, body.meta.get("generation"))
    return {name: {"metadata": dict(body.meta), "spec": dict(body.spec), "status": dict(body.get("status") or {})}}


@kopf.index(c.GROUP, c.VERSION, c.BUDGET_SHARD_PLURAL)
def budget_shard_index(body: kopf.Body, labels: Mapping[str, str], **_: Any) -> dict[str, dict[str, Any]]:
    """The Budgets' shards (their tenants' months and slices), by the Budget's uid."""
    return {str(labels.get(c.LABEL_BUDGET_OWNER, "")): dict(body)}


def platform(kwargs: Mapping[str, Any]) -> list[PlatformBudget]:
    """The Budgets a handler was given (the index), each status joined with its shards (budget_shards.py); one
    that cannot be read covers nothing (its own status says why)."""
    index, shard_index = kwargs.get("budget_index"), kwargs.get("budget_shard_index")
    budgets = []
    for store in (index.values() if index is not None else []):
        for obj in store:
            uid = str((obj.get("metadata") or {}).get("uid", ""))
            shards = owned(shard_index.get(uid, []) if shard_index is not None else [], uid)
            try:
                budgets.append(parse_budget({**obj, "status": joined_status(obj.get("status") or {}, shards)}))
            except BudgetSpecError:
                continue
    return budgets


@kopf.daemon(c.GROUP, c.VERSION, c.PLURAL, cancellation_timeout=5)
async def budget_asks(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    """With budgets (the pass says: memory.budgeted): long-poll the pods, and run a round (scrape, book, lease) as
    soon as a request waits for allowance or a started pod waits for its first lease, or its Budget changed its
    slices, instead of at the next scrape: a top-up comes in about a second."""
    meta = {"name": body.meta["name"], "namespace": body.meta["namespace"], "uid": body.meta["uid"]}
    ctx: Context = memo.context
    woken = ctx.wakeup((meta["namespace"], meta["name"]))
    while not stopped:
        try:
            if await asked_or_woken(ctx, meta, woken, memory(memo).budgeted):
                woken.clear()
                memory(memo).scrape_now = True
                await run(body, memo, apply_children=False, platform=platform(kwargs))
        except (KubeError, SpecError, kopf.TemporaryError) as error:
            logging.getLogger("tally_operator").info("Budget asks of %s/%s not read: %s", meta["namespace"],
                                                     meta["name"], error)
        await stopped.wait(ASKS_PACE_SECONDS)


async def asked_or_woken(ctx: Context, meta: Mapping[str, str], woken: asyncio.Event, budgeted: bool) -> bool:
    """Whether a round should run now: a pod asks (only when budgeted), or the service was woken; at most a
    long-poll's time."""
    waits: list[asyncio.Task[bool]] = [asyncio.create_task(woken.wait())]
    if budgeted:
        waits.append(asyncio.create_task(asked(ctx, meta, wait=ASKS_POLL_SECONDS)))
    try:
        done, _ = await asyncio.wait(waits, timeout=ASKS_POLL_SECONDS + 5, return_when=asyncio.FIRST_COMPLETED)
        return woken.is_set() or any(task.result() is True for task in done if not task.exception())
    finally:
        for task in waits:
            task.cancel()


@kopf.daemon(c.GROUP, c.VERSION, c.BUDGET_PLURAL, cancellation_timeout=5)
async def budget_rounds(name: str, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    """A platform Budget's rounds (budget_round.py): every BUDGET_ROUND_SECONDS, and at once when a service it
    covers has requests waiting for more than its slice."""
    ctx: Context = memo.context
    woken = ctx.wakeup(("Budget", name))
    while not stopped:
        woken.clear()
        try:
            if not await budget_round(ctx, name, platform(kwargs)):
                return
        except KubeError as error:
            logging.getLogger("tally_operator").info("Budget %s: round failed: %s", name, error)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), BUDGET_ROUND_SECONDS)
        await stopped.wait(ASKS_PACE_SECONDS)


def memory(memo: kopf.Memo) -> ServiceMemory:
    """The resource's own memory (kopf keeps one memo per resource, across passes and handlers)."""
    kept = memo.get("service")
    if kept is None:
        kept = memo["service"] = ServiceMemory()
    return kept


async def run(body: kopf.Body, memo: kopf.Memo, apply_children: bool, platform: list[PlatformBudget]) -> None:
    """The resource's pass, with its own memory; a transient API error is retried by kopf."""
    try:
        await reconcile(memo.context, body, memory(memo), apply_children, platform)
    except KubeError as error:  # only transient ones leave the pass
        raise kopf.TemporaryError(f"API server: {error.status} {error.message}", delay=RETRY_SECONDS) from error
