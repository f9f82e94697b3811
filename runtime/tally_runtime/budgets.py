"""Token budgets and rate limits per tenant: reserve at admission, settle to the engine's count.

The operator leases each pod, per tenant, an allowance (tally_operator/budget.py): a value of the tenant's
own counter on this pod (its counted tokens under this process's epoch, the counter the operator books)
up to which the pod may spend, and a share of the tenant's tokens-per-minute rate. A request reserves its
worst case before it is admitted: every prompt token once per choice and `max_tokens` per choice (a request
without `max_tokens` reserves up to the context length). It is refused with 429 unless the tenant's counter,
what its requests in flight reserved, and this reservation together stay within the allowance, and the
tokens reserved or spent in the last minute stay within the rate share. When the request ends, however it
ends, its reservation is settled: the counter has grown by what the engine billed (which is never more
than was reserved), and the reservation is returned. So a pod never spends past its lease, and the
operator keeps the leases of all pods within the tenant's budget.

A tenant the message does not list is unlimited when the service has no default budget, else it has no
allowance yet. A request that does not fit in what its tenant has left of its budget anywhere (`unspent` in
the message, less what this pod spent and reserved since) is refused at once with `insufficient_quota` (and
`x-should-retry: false`: the OpenAI SDKs would retry a 429 otherwise, for nothing). One that fits only once
this pod's own requests in flight return what they reserved and did not spend waits for them to end. One that
does fit but not in the allowance here waits (`acquire`), as a request waits for a generation slot, while the
pod asks for more: the tenants' waiting demand is on /metrics (`tally_budget_wanted_tokens{tenant}`) and on a
long-poll the operator keeps open (`GET /internal/budgets/asks`), which answers the moment a request starts
waiting, so the operator grants (or reclaims from idle pods and then grants) between its rounds. The waiters
are served in arrival order as lease messages come; only a request still waiting when its time is up gets
`rate_limit_exceeded` with Retry-After. Before the first lease message nothing is served (a pod is not Ready
until then), and a request that arrives meanwhile waits for it likewise.

Lease messages are numbered (`seq`); a pod applies only a number above the last it applied, so a late
message never undoes a newer one. An allowance may go down (the operator takes back what an idle pod
holds, to lease it where the tenant is asking); requests already admitted keep their reservations. So what
the pod may still reach is `max(allowance, counter + reserved)`, which only falls until the next message:
it is on /metrics (`tally_budget_allowance_tokens`) with the number of the message applied
(`tally_budget_lease_sequence`), and that is how the operator learns it may count the lower allowance.
The state lives on the event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tally_runtime.protocol import ApiError
from tally_runtime.units import COUNTS, Weights, weights_of

WINDOW_SECONDS = 60.0
MAX_WANTED = 1000  # tenants asked for at once (the operator reads at most this many per pod)
WANTED_SECONDS = 300.0  # an ask not answered in this long is dropped (the tenant asks again when refused)
QUOTA_CODE = "insufficient_quota"
RATE_CODE = "rate_limit_exceeded"


class StaleLease(ValueError):
    """A lease message numbered at or below the last one applied."""


class NeedsAllowance(Exception):
    """The request fits what its tenant has left, but not the allowance here (yet): it may wait for more."""

    def __init__(self, limit: float, remaining: float) -> None:
        super().__init__("more allowance is needed here")
        self.limit, self.remaining = limit, remaining


@dataclass(frozen=True, slots=True)
class Lease:
    allowance: float | None = None  # counter value the tenant may spend up to (None: no budget)
    tokens_per_minute: float | None = None  # this pod's share of the rate (None: no rate limit)
    unspent: float | None = None  # what the tenant had left of its budget when the message was made
    counter_at: float = 0.0  # the tenant's counter here when the message was applied
    untracked: str = ""  # why the operator cannot keep this tenant's books (its ledger is full): refused, never free


@dataclass(slots=True)
class Reservation:
    tenant: str
    tokens: float  # reserved at admission
    at: float  # monotonic time it was made
    in_window: float = 0.0  # what it counts for in the rate window: the reservation, then what was billed
    settled: bool = False


@dataclass
class Budgets:
    """The pod's leases and reservations. `counter(tenant)` is the tenant's counted tokens so far."""

    counter: Callable[[str], float]
    weights: Weights = COUNTS["total"]  # the budget's unit: what the counter counts (the lease message says)
    epoch: float = 0.0
    leases: dict[str, Lease] = field(default_factory=dict)
    starter: Lease = field(default_factory=Lease)  # for tenants the lease message does not list
    wanted: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (tokens, when): to ask for
    leased: bool = False  # a lease message arrived: until then every request is refused
    seq: int = 0  # the number of the last lease message applied
    reserved: dict[str, float] = field(default_factory=dict)
    window: dict[str, collections.deque[Reservation]] = field(default_factory=dict)
    period_end: float = 0.0  # unix seconds: when a spent budget is renewed (x-ratelimit-reset-tokens)
    on_refused: Callable[[str, str], None] = lambda tenant, code: None
    waiting: dict[str, float] = field(default_factory=dict)  # tenant -> tokens its waiting requests need
    closed: bool = False  # draining: a waiting request is refused (503), and no new one waits
    _applied: asyncio.Future[None] | None = None  # resolved by the next lease message (waiters then try again)
    _settled: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # tenant -> resolved when one of its
    # requests ends (its waiters try again: what it did not spend came back)
    _asked: asyncio.Event = field(default_factory=asyncio.Event)  # set when demand changes (the long-poll)

    def lease(self, tenant: str) -> Lease:
        return self.leases.get(tenant, self.starter)

    async def acquire(self, tenant: str, tokens: float, wait_seconds: float) -> Reservation:
        """Reserve `tokens` for `tenant`, waiting up to `wait_seconds` (in arrival order with the tenant's other
        waiters) while the pod asks for allowance the tenant's budget has; the OpenAI 429 otherwise."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                return self.reserve(tenant, tokens)
            except NeedsAllowance as need:
                if self.closed:
                    raise ApiError(503, "The server is shutting down; retry on another replica",
                                   code="shutting_down", headers={"Retry-After": "1"}) from None
                left = deadline - time.monotonic()
                if left <= 0:
                    self._refuse(tenant, RATE_CODE, "Not enough token allowance for this tenant on this replica, "
                                 "and none came in time: retry shortly", limit=need.limit, remaining=need.remaining,
                                 reset=1.0)
                await self._wait_for_lease(tenant, tokens, left)

    async def _wait_for_lease(self, tenant: str, tokens: float, seconds: float) -> None:
        """Until the next lease message, or one of the tenant's requests here ends, or `seconds` passed."""
        loop = asyncio.get_running_loop()
        if self._applied is None or self._applied.done():
            self._applied = loop.create_future()
        applied = self._applied
        settled = self._settled.get(tenant)
        if settled is None or settled.done():
            settled = self._settled[tenant] = loop.create_future()
        self.waiting[tenant] = self.waiting.get(tenant, 0.0) + tokens
        self._changed_demand()
        try:
            await asyncio.wait({applied, settled}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = self.waiting.get(tenant, 0.0) - tokens
            if left > 0:
                self.waiting[tenant] = left
            else:
                self.waiting.pop(tenant, None)
                self._settled.pop(tenant, None)  # nobody of the tenant waits on it any more

    def close(self) -> None:
        """The drain began: the waiting requests end (503, retried elsewhere), and none waits from now on."""
        self.closed = True
        if self._applied is not None and not self._applied.done():
            self._applied.set_result(None)

    def _changed_demand(self) -> None:
        self._asked.set()
        self._asked = asyncio.Event()

    async def wait_for_asks(self, seconds: float) -> None:
        """The operator's long-poll: returns as soon as a request waits (or a first lease is wanted), or after
        `seconds`. An ask whose request gave up does not end it (the next scrape reads that one)."""
        if self.waiting or not self.leased:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._asked.wait(), seconds)

    def reserve(self, tenant: str, tokens: float, now: float | None = None) -> Reservation:
        """Reserve `tokens` for `tenant`; the OpenAI 429 when the tenant's budget does not cover it (or its rate
        is reached), NeedsAllowance when it does but this pod's allowance does not (nothing reserved then)."""
        now = time.monotonic() if now is None else now
        if not self.leased:
            self._ask(tenant, tokens, now)
            raise NeedsAllowance(0, 0)
        lease = self.lease(tenant)
        if lease.untracked:
            self.refuse_untracked(tenant, lease.untracked)
        reserved = self.reserved.get(tenant, 0.0)
        if lease.allowance is not None:
            counter = self.counter(tenant)
            remaining = lease.allowance - counter - reserved
            anywhere = math.inf if lease.unspent is None or self.month_over() else \
                lease.unspent - (counter - lease.counter_at) - reserved
            if tokens > remaining and tokens > anywhere:
                if tokens <= anywhere + reserved:  # it fits once this pod's requests in flight return what they
                    raise NeedsAllowance(lease.allowance, remaining)  # did not spend: it waits for them to end
                self._refuse(tenant, QUOTA_CODE, f"The tenant's token budget does not cover this request ({tokens:.0f} "
                             f"tokens reserved for it, {max(0.0, anywhere):.0f} left)",
                             limit=lease.allowance, remaining=remaining,
                             reset=max(1.0, self.period_end - time.time()) if self.period_end else 60.0)
            if tokens > remaining:  # asked for: the operator leases more here (or says there is none)
                self._ask(tenant, tokens, now)
                raise NeedsAllowance(lease.allowance, remaining)
        reservation = Reservation(tenant, tokens, now, tokens)
        if lease.tokens_per_minute is not None:
            recent = self._recent(tenant, now)
            used = sum(r.in_window for r in recent)
            if used + tokens > lease.tokens_per_minute:
                reset = (recent[0].at + WINDOW_SECONDS - now) if recent else WINDOW_SECONDS
                self._refuse(tenant, RATE_CODE, f"Rate limit of {lease.tokens_per_minute:.0f} tokens per minute "
                             f"reached here ({tokens:.0f} tokens reserved for this request)",
                             limit=lease.tokens_per_minute, remaining=lease.tokens_per_minute - used,
                             reset=max(1.0, reset))
            recent.append(reservation)
        self.reserved[tenant] = reserved + tokens
        return reservation

    def month_over(self) -> bool:
        """The period the last message counted has ended: what it said is left is of the month before (the
        budget is renewed), so nothing is refused for it until the next message; requests ask instead."""
        return bool(self.period_end) and time.time() >= self.period_end

    def _ask(self, tenant: str, tokens: float, now: float) -> None:
        if len(self.wanted) < MAX_WANTED or tenant in self.wanted:
            self.wanted[tenant] = (max(self.wanted.get(tenant, (0.0, 0.0))[0], tokens), now)

    def refuse_untracked(self, tenant: str, why: str) -> None:
        """A tenant whose spend cannot be booked is refused (a budget that cannot count fails closed)."""
        self._refuse(tenant, QUOTA_CODE, f"This tenant's usage cannot be tracked ({why}), so no budget can cover it",
                     limit=0, remaining=0, reset=max(1.0, self.period_end - time.time()) if self.period_end else 60.0)

    def settle(self, reservation: Reservation, billed: float) -> None:
        """The request ended (its usage already counted): return its reservation, and in the rate window
        replace what it reserved by what it spent. Exactly once per reservation."""
        if reservation.settled:
            return
        reservation.settled = True
        left = self.reserved.get(reservation.tenant, 0.0) - reservation.tokens
        if left > 0:
            self.reserved[reservation.tenant] = left
        else:
            self.reserved.pop(reservation.tenant, None)
        reservation.in_window = min(reservation.tokens, billed)
        settled = self._settled.pop(reservation.tenant, None)
        if settled is not None and not settled.done():  # the tenant's waiters try again
            settled.set_result(None)

    def remaining(self, tenant: str) -> float | None:
        allowance = self.lease(tenant).allowance
        if allowance is None:
            return None
        return max(0.0, allowance - self.counter(tenant) - self.reserved.get(tenant, 0.0))

    def reach(self, tenant: str) -> float | None:
        """The counter value this pod may still reach for a listed tenant: its allowance, or more if requests
        admitted under an earlier, higher one still hold reservations. Only falls until the next message."""
        allowance = self.lease(tenant).allowance
        if allowance is None:
            return None
        return max(allowance, self.counter(tenant) + self.reserved.get(tenant, 0.0))

    def asking(self, now: float | None = None) -> dict[str, float]:
        """Tenants that want more allowance here, and how much: what their waiting requests need together, or
        for a recent ask not waiting any more (its request gave up), the most it asked for."""
        now = time.monotonic() if now is None else now
        self.wanted = {t: ask for t, ask in self.wanted.items() if ask[1] > now - WANTED_SECONDS}
        asks = {t: tokens for t, (tokens, _) in self.wanted.items()}
        for tenant, tokens in self.waiting.items():
            asks[tenant] = max(asks.get(tenant, 0.0), tokens)
        return asks

    def apply(self, message: Mapping[str, Any], epoch: float) -> None:
        """A lease message from the operator (signature checked by the route): for this process's epoch
        only, and numbered above the last one applied (else StaleLease: a late message changes nothing)."""
        if message.get("epoch") != epoch:
            raise ValueError("the leases are for another epoch of this pod's counters")
        seq = message.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq < 2**63:
            raise ValueError("seq must be a positive integer")
        if seq <= self.seq:
            raise StaleLease(f"lease message {seq} is not newer than {self.seq}, the last applied")
        weights = weights_of(message.get("count", "total"), message.get("weights"))
        tenants = message.get("tenants") or {}
        if not isinstance(tenants, Mapping):
            raise ValueError("tenants must be an object")
        leases = {str(name): _lease(raw, self.counter(str(name))) for name, raw in tenants.items()}
        starter = _lease(message.get("starter") or {}, 0.0)
        self.weights, self.leases, self.starter, self.seq = weights, leases, starter, seq
        # Answered: a tenant now leased something to spend here, or with nothing left anywhere, asks no more
        self.wanted = {t: ask for t, ask in self.wanted.items()
                       if not ((t in leases and (self.remaining(t) or 0.0) > 0) or leases.get(t, starter).unspent == 0)}
        period_end = message.get("periodEnd")
        self.period_end = float(period_end) if isinstance(period_end, int | float) else 0.0
        self.leased = True
        if self._applied is not None and not self._applied.done():  # the waiters try again, in arrival order
            self._applied.set_result(None)

    def _recent(self, tenant: str, now: float) -> collections.deque[Reservation]:
        recent = self.window.setdefault(tenant, collections.deque())
        while recent and recent[0].at <= now - WINDOW_SECONDS:
            recent.popleft()
        return recent

    def _refuse(self, tenant: str, code: str, message: str, limit: float, remaining: float, reset: float) -> None:
        self.on_refused(tenant, code)
        headers = {"x-ratelimit-limit-tokens": str(int(limit)),
                   "x-ratelimit-remaining-tokens": str(max(0, int(remaining))),
                   "x-ratelimit-reset-tokens": duration(reset), "Retry-After": str(max(1, math.ceil(reset)))}
        if code == QUOTA_CODE:  # retrying cannot help before the period ends: the OpenAI SDKs honour this header
            headers["x-should-retry"] = "false"
        error = ApiError(429, message, code=code, headers=headers)
        error.error_type = "insufficient_quota" if code == QUOTA_CODE else "requests"
        raise error


def duration(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `2h3m4s`."""
    seconds = max(0, math.ceil(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _lease(raw: object, counter: float) -> Lease:
    if not isinstance(raw, Mapping):
        raise ValueError("a lease must be an object")
    allowance, rate, unspent = raw.get("allowance"), raw.get("tokensPerMinute"), raw.get("unspent")
    for value in (allowance, rate, unspent):
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value < 0
                                  or not math.isfinite(value)):
            raise ValueError("allowance, tokensPerMinute and unspent must be non-negative numbers")
    untracked = raw.get("untracked") or ""
    if not isinstance(untracked, str):
        raise ValueError("untracked must be a string")
    return Lease(None if allowance is None else float(allowance), None if rate is None else float(rate),
                 None if unspent is None else float(unspent), counter, untracked[:200])


def reservation_tokens(prompt_lengths: list[int], n: int, max_tokens: int, weights: Weights) -> float:
    """A request's worst case in the budget's unit: each prompt once per choice (at the dearer of its cached and
    uncached weight: what will be cached is not known yet), `max_tokens` per choice."""
    prompt = sum(prompt_lengths) * n
    completion = len(prompt_lengths) * n * max_tokens
    return float(prompt * max(weights.prompt, weights.cached) + completion * weights.completion)
