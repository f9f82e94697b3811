"""The only module with kopf decorators. Each handler hands its resource to `reconcile` in a line or two.

Level-triggered: create, update, resume and a periodic timer all run the same reconcile, which never
branches on the event type. A second, faster timer only refreshes status from the children. The timers'
intervals are kopf decorator arguments, so the settings are read when this module is imported; everything
else a pass needs is the `Context` built at start-up and kept in kopf's operator memo.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import kopf

from tally_operator import constants as c
from tally_operator.kube import Kube, KubeError
from tally_operator.metrics import OperatorMetrics
from tally_operator.reconcile import Context, ServiceMemory, reconcile, release_pods
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer

SETTINGS = OperatorSettings.from_env()
RETRY_SECONDS = 10


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
    memo.context = Context(replace(SETTINGS, final_read_key=signer.public_key), Kube(), OperatorMetrics(), signer)
    if SETTINGS.metrics_port:
        memo.context.metrics.serve(SETTINGS.metrics_port, SETTINGS.metrics_address)


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
async def forget(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    memo.context.metrics.forget(namespace or "", name)
    try:
        await release_pods(memo.context, namespace or "", name)
    except KubeError as error:  # the pods then wait out their final read: nothing is lost but time
        logging.getLogger("tally_operator").info("Could not release the pods of %s/%s: %s", namespace, name, error)


@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL)
async def on_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await run(body, memo, apply_children=True)


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=SETTINGS.reconcile_interval, initial_delay=5)
async def periodic_reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await run(body, memo, apply_children=True)


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=SETTINGS.status_interval, idle=0)
async def refresh_status(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await run(body, memo, apply_children=False)


async def run(body: kopf.Body, memo: kopf.Memo, apply_children: bool) -> None:
    """The resource's pass, with its own memory; a transient API error is retried by kopf."""
    memory = memo.get("service")
    if memory is None:
        memory = memo["service"] = ServiceMemory()
    try:
        await reconcile(memo.context, body, memory, apply_children)
    except KubeError as error:  # only transient ones leave the pass
        raise kopf.TemporaryError(f"API server: {error.status} {error.message}", delay=RETRY_SECONDS) from error
