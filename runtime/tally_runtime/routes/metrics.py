"""GET /metrics: Prometheus text exposition of this process's series; POST /internal/final-read: the
operator's acknowledgement that it booked the final counters of a draining runtime (drain.py), signed by
the operator (handoff.py) when the runtime was given its key."""

from __future__ import annotations

import math

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tally_runtime import contract, handoff
from tally_runtime.budgets import StaleLease
from tally_runtime.collect import parse_position
from tally_runtime.protocol import ApiError
from tally_runtime.respond import error_response, json_response, read_body
from tally_runtime.serving import Server

router = APIRouter()
MAX_ACK_BYTES = 4096
MAX_LEASE_BYTES = 256 << 10  # 1,000 tenants' leases, with room


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server: Server = request.app.state.server
    budgets = server.budgets
    if budgets is not None:  # one consistent picture: nothing else runs on the loop while it is taken
        metrics = server.metrics
        for gauge in (metrics.budget_remaining, metrics.budget_reach, metrics.budget_wanted):
            gauge.clear()
        for tenant in budgets.leases:
            remaining, reach = budgets.remaining(tenant), budgets.reach(tenant)
            if remaining is not None and reach is not None:
                metrics.budget_remaining.labels(tenant).set(remaining)
                metrics.budget_reach.labels(tenant).set(reach)
        metrics.budget_sequence.set(budgets.seq)
        for tenant, tokens in budgets.asking().items():
            metrics.budget_wanted.labels(tenant).set(tokens)
    body = server.metrics.render(server.engine.own_metrics(), settled=server.done)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.post(contract.FINAL_READ_PATH)
async def final_read(request: Request) -> Response:
    body = await read_body(request, MAX_ACK_BYTES)  # bounded before it is read: 413 past it
    key = request.app.state.final_read_key
    if key is not None and not handoff.verify(key, body, request.headers.get(handoff.SIGNATURE_HEADER)):
        return error_response(ApiError(403, "The acknowledgement is not signed by this pod's operator",
                                       code="forbidden"))
    try:
        acknowledged = orjson.loads(body)
    except orjson.JSONDecodeError:
        acknowledged = None
    if not isinstance(acknowledged, dict):
        return error_response(ApiError(400, "Expected a JSON object of the counters that were booked"))
    pod_uid = request.app.state.server.metrics.pod_uid
    if key is not None and pod_uid and acknowledged.get("podUid") != pod_uid:
        return error_response(ApiError(403, "The acknowledgement names another pod", code="forbidden"))
    if acknowledged.get("release") is True:
        if not request.app.state.drain.release(acknowledged):
            return error_response(ApiError(409, "Not draining, or not this drain's nonce and epoch (GET this path "
                                                "while the pod drains)", code="not_this_drain"))
        return json_response({"status": "released"})
    if not request.app.state.drain.acknowledge(acknowledged):
        return error_response(ApiError(409, "Not draining and idle, or these are not the final counters",
                                       code="not_final"))
    return json_response({"status": "acknowledged"})


@router.get(contract.FINAL_READ_PATH)
async def final_read_challenge(request: Request) -> Response:
    """While draining: what a release must name (this pod, its counters' epoch, this drain's nonce)."""
    drain = request.app.state.drain
    if drain is None or not drain.nonce:
        return error_response(ApiError(409, "Not draining", code="not_draining"))
    server: Server = request.app.state.server
    return json_response({"podUid": server.metrics.pod_uid, "epoch": server.metrics.totals.epoch,
                          "nonce": drain.nonce})


MAX_ASK_WAIT_SECONDS = 30.0


@router.get(contract.BUDGET_ASKS_PATH)
async def budget_asks(request: Request) -> Response:
    """The operator's long-poll: answers as soon as a request waits for allowance here (or the first lease is
    still to come), else after `wait` seconds (at most 30): what each tenant's waiting requests need
    (`waiting`), and what the next round should lease (`asks`: those, and recent asks whose requests gave up)."""
    server: Server = request.app.state.server
    if server.budgets is None:
        return error_response(ApiError(404, "Budgets are not enabled on this runtime (--budgets)", code="not_found"))
    try:
        wait = min(max(float(request.query_params.get("wait", "0")), 0.0), MAX_ASK_WAIT_SECONDS)
    except ValueError:
        wait = 0.0
    if wait != wait:  # NaN
        wait = 0.0
    await server.budgets.wait_for_asks(wait)
    budgets = server.budgets
    return json_response({"podUid": server.metrics.pod_uid, "epoch": server.metrics.totals.epoch,
                          "seq": budgets.seq, "leased": budgets.leased,
                          "waiting": {t: math.ceil(v) for t, v in sorted(budgets.waiting.items())},
                          "asks": {t: math.ceil(v) for t, v in sorted(budgets.asking().items())}})


@router.post(contract.BUDGETS_PATH)
async def budgets(request: Request) -> Response:
    """The operator's leases per tenant, signed like the final-read acknowledgement (budgets.py)."""
    server: Server = request.app.state.server
    if server.budgets is None:
        return error_response(ApiError(404, "Budgets are not enabled on this runtime (--budgets)", code="not_found"))
    body = await read_body(request, MAX_LEASE_BYTES)
    key = request.app.state.final_read_key
    if key is not None and not handoff.verify(key, body, request.headers.get(handoff.SIGNATURE_HEADER)):
        return error_response(ApiError(403, "The leases are not signed by this pod's operator", code="forbidden"))
    try:
        message = orjson.loads(body)
        if not isinstance(message, dict):
            raise ValueError("expected a JSON object")
        pod_uid = server.metrics.pod_uid
        if key is not None and pod_uid and message.get("podUid") != pod_uid:
            return error_response(ApiError(403, "The leases name another pod", code="forbidden"))
        server.budgets.apply(message, server.metrics.totals.epoch)
    except StaleLease as err:
        return error_response(ApiError(409, f"Not applied: {err}", code="stale_lease"))
    except (orjson.JSONDecodeError, ValueError) as err:
        return error_response(ApiError(400, f"Not a lease message: {err}"))
    return json_response({"status": "applied", "seq": server.budgets.seq, "tenants": len(server.budgets.leases)})


@router.get(contract.RECORDS_PATH)
async def records(request: Request) -> Response:
    """--usage-records-pull: the records from the last acknowledged position, for the operator to forward (the
    same ones until it acknowledges them). Off the event loop's hot path: a read of the spool's files."""
    collection = getattr(request.app.state, "collection", None)
    if collection is None:
        return error_response(ApiError(404, "Records are not kept for collection here (--usage-records-pull)",
                                       code="not_found"))
    try:
        limit = int(request.query_params.get("max", "1000"))
    except ValueError:
        limit = 1000
    server: Server = request.app.state.server
    return json_response({"podUid": server.metrics.pod_uid, "epoch": server.metrics.totals.epoch,
                          **await collection.page(limit)})


@router.post(contract.RECORDS_ACK_PATH)
async def records_ack(request: Request) -> Response:
    """The operator forwarded the records before `through`: the spool reclaims them. Signed like the final read."""
    collection = getattr(request.app.state, "collection", None)
    if collection is None:
        return error_response(ApiError(404, "Records are not kept for collection here (--usage-records-pull)",
                                       code="not_found"))
    body = await read_body(request, MAX_ACK_BYTES)
    key = request.app.state.final_read_key
    if key is not None and not handoff.verify(key, body, request.headers.get(handoff.SIGNATURE_HEADER)):
        return error_response(ApiError(403, "The acknowledgement is not signed by this pod's operator",
                                       code="forbidden"))
    server: Server = request.app.state.server
    try:
        message = orjson.loads(body)
        if not isinstance(message, dict):
            raise ValueError("expected a JSON object")
        if key is not None and server.metrics.pod_uid and message.get("podUid") != server.metrics.pod_uid:
            return error_response(ApiError(403, "The acknowledgement names another pod", code="forbidden"))
        count = collection.acknowledge(parse_position(message.get("through")))
    except (orjson.JSONDecodeError, ValueError) as err:
        return error_response(ApiError(409, f"Not acknowledged: {err}", code="not_acknowledged"))
    return json_response({"status": "acknowledged", "records": count, "pending": collection.pending})
