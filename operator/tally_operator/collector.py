"""I/O: the platform's record delivery. After a round's status write has landed, the operator reads the usage
records each pod keeps for it (`GET /internal/records` on the metrics port: tally_runtime/collect.py), forwards
them to the platform's billing system as CloudEvents batches with the platform's credentials (a token file of
the operator's own Secret, the platform's CAs and proxy), and only once the receiver took them acknowledges
them to the pod (signed, like the final read), which then reclaims them. At least once: a receiver that failed,
or an operator that died between forwarding and acknowledging, gets them again, with the same event ids.

A record is forwarded only if it is its pod's: its `source` names the service's namespace and name. Records a
pod cannot vouch for (written before its runtime restarted) are forwarded and counted (`unverified`); lines the
runtime did not write are never returned to us (the pod counts them refused)."""

from __future__ import annotations

import json
import logging
import os
import ssl
from collections.abc import Mapping
from typing import Any

import httpx

from tally_operator.scrape import post_all, scrape
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer
from tally_runtime.contract import FINAL_READ_SIGNATURE_HEADER, RECORDS_ACK_PATH, RECORDS_PATH

log = logging.getLogger("tally_operator")
READ_RECORDS = 2000  # records read from a pod at a time
BATCH = 500  # records per POST to the billing system
MAX_READS = 10  # reads per pod per round: a backlog drains over rounds, and a round stays bounded
MAX_READ_BYTES = 8 << 20
CONTENT_TYPE = "application/cloudevents-batch+json"


MAX_TOKENS = 2**31 - 1  # a count above this in one record is no request's (a context is far smaller)
COUNTS = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")


def forwardable(answer: Mapping[str, Any], namespace: str, name: str) -> tuple[list[Any], int]:
    """PURE: the events of a pod's answer that are its service's to forward, and how many were not (left out). An
    event the pod could not vouch for (`verified` false: written before its runtime restarted, or appended by a
    shell in the pod) must also read as a record of this service could: its `data` names this service (or, as
    records before those fields did, none), its tenant is its subject, and its counts are whole numbers a request
    can have (a forged line claimed another team's namespace and -5,000,000 and +9,000,000,000 tokens)."""
    prefix = f"/namespaces/{namespace}/completionservices/{name}/pods/"
    events, foreign = [], 0
    for item in answer.get("records") or []:
        event = item.get("event") if isinstance(item, Mapping) else None
        if isinstance(event, Mapping) and str(event.get("source", "")).startswith(prefix) and event.get("id") and \
                (item.get("verified") is True or plausible(event, namespace, name)):
            events.append(event)
        else:
            foreign += 1
    return events, foreign


def plausible(event: Mapping[str, Any], namespace: str, name: str) -> bool:
    """PURE: whether an unverified event reads as a usage record of this service (see `forwardable`)."""
    data = event.get("data")
    if not isinstance(data, Mapping) or (data.get("namespace"), data.get("service")) not in {(namespace, name),
                                                                                          ("", "")}:
        return False
    if not isinstance(data.get("tenant"), str) or event.get("subject") != data["tenant"]:
        return False
    counts = [value for value in (data.get(field) for field in COUNTS)
              if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS]
    if len(counts) != len(COUNTS):
        return False
    prompt, completion, cached, reasoning = counts
    return cached <= prompt and reasoning <= completion


class Forwarder:
    """The client to the platform's billing system (the operator's settings). Nothing it is configured with can
    stop the operator: a CA bundle that is not one (it kept the operator from starting, so no service was booked)
    fails delivery alone, saying why on every round's warning; the token is read again when its file changes (a
    rotated Secret got 401s until the operator restarted)."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.url = settings.records_url
        self.token_file = settings.records_token_file
        self.token_stamp: tuple[int, int] | None = None
        self.token = ""
        self.broken = ""  # why nothing can be delivered (the CA bundle is unusable)
        verify: ssl.SSLContext | bool = True
        if settings.records_ca:
            try:
                verify = ssl.create_default_context(cadata=settings.records_ca)
            except (ssl.SSLError, ValueError) as err:
                self.broken = f"usageRecords.caBundle is not PEM CA certificates ({err})"
                log.error("Usage records cannot be delivered: %s", self.broken)
        self.client = httpx.AsyncClient(timeout=30, trust_env=False, verify=verify,
                                        proxy=settings.records_proxy or None)

    @property
    def headers(self) -> dict[str, str]:
        """The request's headers, the token read again whenever its file (a mounted Secret) changed."""
        if self.token_file:
            try:
                stat = os.stat(self.token_file)
                stamp = (stat.st_mtime_ns, stat.st_ino)
                if stamp != self.token_stamp:
                    with open(self.token_file, "rb") as f:
                        self.token = f.read(4096).decode("utf-8", "replace").strip()
                    self.token_stamp = stamp
            except OSError as err:
                log.warning("The billing system's token file cannot be read (%s): the last one read is used", err)
        return {"Content-Type": CONTENT_TYPE, **({"Authorization": f"Bearer {self.token}"} if self.token else {})}

    async def send(self, events: list[Any]) -> None:
        """Every event to the receiver, in batches; raises unless every batch was taken (2xx)."""
        if self.broken:
            raise RuntimeError(self.broken)
        for start in range(0, len(events), BATCH):
            body = json.dumps(events[start:start + BATCH], separators=(",", ":")).encode()
            response = await self.client.post(self.url, content=body, headers=self.headers)
            if not 200 <= response.status_code < 300:
                raise RuntimeError(f"the billing system answered {response.status_code}")


async def collect(forwarder: Forwarder, signer: Signer, per_call_seconds: float, meta: Mapping[str, str],
                  urls: Mapping[str, str]) -> dict[str, int]:
    """Forward the records of each pod (uid -> its metrics base URL) and acknowledge them; what was forwarded,
    per pod uid. A pod whose records could not be forwarded keeps them (the next round tries again)."""
    forwarded: dict[str, int] = {}
    for uid, base in sorted(urls.items()):
        for _ in range(MAX_READS):
            answers = await scrape({uid: f"{base}{RECORDS_PATH}?max={READ_RECORDS}"}, 1, per_call_seconds,
                                   max_bytes=MAX_READ_BYTES)
            text = answers[uid]
            if isinstance(text, Exception):  # 404: a pod that keeps no records for us (its service delivers)
                break
            try:
                answer = json.loads(text)
            except (ValueError, RecursionError):
                break
            if not isinstance(answer, dict) or answer.get("podUid") != uid:
                break
            events, foreign = forwardable(answer, meta["namespace"], meta["name"])
            if foreign:
                log.warning("Pod %s of %s/%s returned %d record(s) of another service, or unverified ones that "
                            "cannot be its records: not forwarded", uid, meta["namespace"], meta["name"], foreign)
            if answer.get("from") == answer.get("through"):
                break
            try:
                if events:
                    await forwarder.send(events)
            except (httpx.HTTPError, RuntimeError) as err:
                log.warning("Forwarding %d usage record(s) of pod %s failed (%s): the pod keeps them", len(events),
                            uid, err)
                return forwarded
            if not await acknowledge(signer, base, uid, answer, per_call_seconds):
                break
            forwarded[uid] = forwarded.get(uid, 0) + len(events)
            if not answer.get("pending") or len(answer.get("records") or []) < READ_RECORDS:
                break
    return forwarded


async def acknowledge(signer: Signer, base: str, uid: str, answer: Mapping[str, Any],
                      per_call_seconds: float) -> bool:
    body = json.dumps({"podUid": uid, "epoch": answer.get("epoch"), "through": answer.get("through")},
                      sort_keys=True, separators=(",", ":")).encode()
    results = await post_all({uid: (base + RECORDS_ACK_PATH, body, {FINAL_READ_SIGNATURE_HEADER: signer.sign(body)})},
                             1, per_call_seconds)
    if results[uid] != 200:
        log.info("The acknowledgement of pod %s's records was not taken: %r", uid, results[uid])
        return False
    return True
