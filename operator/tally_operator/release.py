"""Releasing the pods of a deleted CompletionService from a final read nobody will book: they are made to drain
at once and each is released, signed, for the very drain it is in (its epoch and the nonce of that drain)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from tally_operator import constants as c
from tally_operator.books import signed
from tally_operator.context import Context
from tally_operator.scrape import post_all, scrape
from tally_operator.usage import (
    controller_uid,
    pod_url,
)
from tally_runtime.contract import FINAL_READ_PATH

log = logging.getLogger("tally_operator")


async def release_pods(ctx: Context, meta: Mapping[str, str]) -> int:
    """The CompletionService is being deleted, and its ledger with it: its pods are made to drain now (its
    Deployment deleted, rather than after the CompletionService is gone) and each draining one is let exit
    without waiting for a final read nobody will book. A release is signed and names its pod, the pod's counters'
    epoch and the nonce of the drain it ends (read from the pod just before): it ends that drain and no later
    one, so a release sent (or read off the plaintext metrics port) once can never let an adopted pod skip its
    final read afterwards. Returns how many pods still run and were not released (not draining yet)."""
    namespace, name = meta["namespace"], meta["name"]
    deployment = await asyncio.to_thread(ctx.kube.get, "apps/v1", "Deployment", name, namespace)
    if deployment is not None and controller_uid(deployment) == meta["uid"] and \
            not deployment["metadata"].get("deletionTimestamp"):
        await asyncio.to_thread(ctx.kube.delete, "apps/v1", "Deployment", name, namespace,
                                uid=deployment["metadata"]["uid"])
    pods = [pod for pod in await asyncio.to_thread(ctx.kube.pods, namespace, f"{c.LABEL_SERVICE}={name}")
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    urls = {str(pod["metadata"]["uid"]): pod_url(str(pod["status"]["podIP"]), c.RUNTIME_METRICS_PORT, FINAL_READ_PATH)
            for pod in pods if pod["metadata"].get("uid") and (pod.get("status") or {}).get("podIP")}
    challenges = await scrape(urls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout, MAX_CHALLENGE_BYTES)
    calls = {}
    for uid, answer in challenges.items():
        challenge = drain_challenge(answer, uid)
        if challenge is not None:  # a pod not draining yet gets its release on a later try
            calls[uid] = signed(ctx.signer, urls[uid], {"podUid": uid, "release": True, **challenge})
    released = await post_all(calls, ctx.settings.scrape_concurrency, ctx.settings.scrape_timeout) if calls else {}
    done = sum(1 for result in released.values() if result == 200)
    if done:
        log.info("Released %d draining pod(s) of deleted %s/%s from their final read", done, namespace, name)
    return sum(1 for pod in pods if pod["metadata"].get("uid") and released.get(pod["metadata"]["uid"]) != 200)

MAX_CHALLENGE_BYTES = 4096

def drain_challenge(answer: str | Exception, uid: str) -> dict[str, Any] | None:
    """A draining pod's challenge (its epoch and nonce) from its answer; None for anything else."""
    if isinstance(answer, Exception):
        return None
    try:
        parsed = json.loads(answer)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("podUid") not in (uid, ""):
        return None
    epoch, nonce = parsed.get("epoch"), parsed.get("nonce")
    if not isinstance(epoch, int | float) or isinstance(epoch, bool) or not isinstance(nonce, str) or \
            not 0 < len(nonce) <= 64:
        return None
    return {"epoch": epoch, "nonce": nonce}
