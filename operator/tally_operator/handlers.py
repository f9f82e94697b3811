"""The only module with kopf decorators. Each handler delegates to `reconcile` in a few lines.

Level-triggered: create, update, resume and a periodic timer all run the same reconcile, which never
branches on the event type. A second, faster timer only refreshes status from the children.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from tally_operator import constants as c
from tally_operator.conditions import Verdict, transitions
from tally_operator.desired import desired_deployment, desired_pdb, desired_service, endpoint
from tally_operator.kube import Kube, is_transient
from tally_operator.metrics import OperatorMetrics
from tally_operator.samples import MetricsParseError, parse_sample
from tally_operator.scrape import scrape
from tally_operator.settings import OperatorSettings
from tally_operator.spec import Spec, SpecError, parse_spec
from tally_operator.status import (
    build_status,
    invalid_verdicts,
    observed_fields,
    without_times,
    workload_verdicts,
)
from tally_operator.usage import Round, UsageState, absorb, scrape_targets, state_from_status, usage_status
from tally_operator.verdict import judge

SETTINGS = OperatorSettings.from_env()
METRICS = OperatorMetrics()
LOG = logging.getLogger("tally_operator")
MEMO_SECONDS = 10.0  # how long our own last write outranks a possibly stale body
_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's own bookkeeping goes to annotations, so the status schema can stay strict.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=c.GROUP)
    settings.posting.level = logging.WARNING
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]
    settings.watching.server_timeout = 120
    # Handlers are sync (the Kubernetes client blocks) and run in kopf's thread pool. On 2 cores its
    # default size did better than 32 threads (benchmarks/README.md); larger machines may raise it.
    if SETTINGS.workers:
        settings.execution.max_workers = SETTINGS.workers
    settings.peering.name = "tally-operator"
    settings.peering.clusterwide = True
    kube()
    if SETTINGS.metrics_port:
        METRICS.serve(SETTINGS.metrics_port, SETTINGS.metrics_address)


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def forget(name: str, namespace: str | None, **_: Any) -> None:
    METRICS.forget(namespace or "", name)


@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    reconcile(body, patch, memo, apply_children=True)


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=SETTINGS.reconcile_interval, initial_delay=5)
def periodic_reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    reconcile(body, patch, memo, apply_children=True)


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=SETTINGS.status_interval, idle=0)
def refresh_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    reconcile(body, patch, memo, apply_children=False)


def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, apply_children: bool) -> None:
    """One pass for one resource. Passes of the same resource (timers, events) run one at a time, so
    an older reading of the children can never overwrite a newer status."""
    with memo.setdefault("lock", threading.Lock()):
        _reconcile(body, patch, memo, apply_children)


def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, apply_children: bool) -> None:
    meta = {"name": body.meta["name"], "namespace": body.meta["namespace"], "uid": body.meta["uid"]}
    generation = int(body.meta.get("generation") or 0)
    previous = dict(body.get("status") or {})
    try:
        spec = parse_spec(body.spec)
    except SpecError as error:
        write_status(body, patch, memo, previous, build_status(previous, invalid_verdicts(error), now(), generation,
                                                         {"endpoint": endpoint(meta, SETTINGS)}))
        return
    try:
        if apply_children:
            apply_all(meta, spec)
            memo.pop("apply_error", None)
        deployment = kube().get("apps/v1", "Deployment", meta["name"], meta["namespace"])
        pods = kube().pods(meta["namespace"], f"{c.LABEL_SERVICE}={meta['name']}")
    except ApiException as error:
        if is_transient(error):
            raise kopf.TemporaryError(f"API server: {error.status} {error.reason}", delay=10) from error
        memo["apply_error"] = rejected(error)
        deployment, pods = None, []
    if memo.get("apply_error") is not None:  # until a pass applies cleanly, the rejection is the news
        write_status(body, patch, memo, previous, build_status(
            previous, invalid_verdicts(memo["apply_error"]), now(), generation, {"endpoint": endpoint(meta, SETTINGS)}))
        return
    fields = observed_fields(meta["name"], deployment, endpoint(meta, SETTINGS))
    verdicts = workload_verdicts(spec, deployment, pods)
    checked = check_usage(meta, spec, pods, memo, previous)
    if checked is not None:
        fields["usage"], usage_verdict, unaccounted = checked
        verdicts.append(usage_verdict)
        if unaccounted:
            kopf.event(body, type="Warning", reason="UsageUnaccounted",
                       message=f"{unaccounted} pod(s) went away or restarted their counters before their last "
                               "counters were read: what they served since the scrape before is not in the totals")
    write_status(body, patch, memo, previous, build_status(previous, verdicts, now(), generation, fields))


def check_usage(meta: dict[str, str], spec: Spec, pods: list[dict[str, Any]], memo: kopf.Memo,
                previous: dict[str, Any]) -> tuple[dict[str, object], Verdict, int] | None:
    """Scrape the service's pods when its scrape interval is due; None when it is not.

    Returns the new `status.usage`, the UsageHealthy verdict and how many pods this round found
    unaccounted. The readings the totals stand on go into the same status write, so a restarted
    operator continues from exactly there."""
    if time.monotonic() - memo.get("scraped_at", -1e9) < spec.scrape_interval_seconds:
        return None
    memo["scraped_at"] = time.monotonic()
    if "usage" not in memo:  # first round in this process: continue from the status
        memo["usage"] = state_from_status(previous.get("usage") or {})
    state: UsageState = memo["usage"]
    targets = scrape_targets(pods, state.readings, c.RUNTIME_PORT)
    results = asyncio.run(scrape(targets, SETTINGS.scrape_concurrency, SETTINGS.scrape_timeout))
    samples, failed = {}, set()
    for uid, result in results.items():
        try:
            if isinstance(result, Exception):
                raise result
            samples[uid] = parse_sample(result)
        except (Exception, MetricsParseError) as err:  # one pod's failure is that pod's alone
            failed.add(uid)
            LOG.info("Scraping pod %s of %s/%s failed: %s", uid, meta["namespace"], meta["name"], err)
    round_ = Round(samples, frozenset(failed), present=frozenset(p["metadata"]["uid"] for p in pods))
    unaccounted = state.unaccounted
    increase = absorb(state, round_)
    verdict = judge(state, round_, spec.max_mismatch_ratio)
    METRICS.record(meta["namespace"], meta["name"], increase, verdict.status, len(samples), len(failed),
                   state.unaccounted - unaccounted, state.tenant_increase)
    return usage_status(state, round_, now()), verdict, state.unaccounted - unaccounted


def rejected(error: ApiException) -> SpecError:
    """A non-transient API refusal: our RBAC (403) or a child the server finds invalid (400/422)."""
    reason = "Forbidden" if error.status == 403 else "InvalidChild"
    return SpecError(reason, f"The API server refused a child object: {_api_message(error)}")


def apply_all(meta: dict[str, str], spec: Spec) -> None:
    kube().apply(desired_deployment(meta, spec, SETTINGS))
    kube().apply(desired_service(meta))
    pdb = desired_pdb(meta, spec)
    if pdb is not None:
        kube().apply(pdb)
    else:
        kube().delete("policy/v1", "PodDisruptionBudget", meta["name"], meta["namespace"])


def write_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, previous: dict[str, Any],
                 status: dict[str, Any]) -> None:
    """Write only on change; post an Event for every condition that flipped.

    `memo` remembers what this process last wrote, so a timer racing an event handler over the same
    stale body does not write (or announce) the same transition twice.
    """
    written_at, written = memo.get("status", (0.0, None))
    known = written if written is not None and time.monotonic() - written_at < MEMO_SECONDS else previous
    if without_times(status) == without_times(known):
        return
    memo["status"] = (time.monotonic(), status)
    patch.status.update(status)
    for condition in transitions(known.get("conditions") or [], status["conditions"]):
        kopf.event(body, type="Warning" if is_bad(condition) else "Normal",
                   reason=f"{condition['type']}{condition['status']}"[:128],
                   message=f"{condition['reason']}: {condition['message']}"[:1024])


def is_bad(condition: dict[str, Any]) -> bool:
    kind, status = condition["type"], condition["status"]
    if kind == c.DEGRADED:
        return bool(status == "True")
    if kind == c.PROGRESSING:
        return bool(condition["reason"] == c.REASON_UNSCHEDULABLE)
    return bool(status == "False")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_message(error: ApiException) -> str:
    import json

    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)
