"""PURE: per-tenant token budgets across a service's pods: what each pod may spend (its lease), so that the
sum of what all pods spend never exceeds a tenant's budget for the period.

Budgets are counted from the ledger (usage.py), a calendar month in UTC at a time: a tenant's spend this
period is its ledger total now minus its total when the period began. A pod's lease for a tenant is an
allowance on the pod's own counter for that tenant (counted tokens under its epoch, the counter the ledger
books): the runtime admits a request only if the counter, what its requests in flight reserved, and the
request's worst case stay within the allowance (tally_runtime/budgets.py). So what a pod may still spend
beyond its last reading is at most `allowance - reading`, and the operator keeps, per tenant,

    spent this period + what every pod may still spend + what ended pods may have spent unread <= budget

by granting only what is free under that bound. Leases are written into the status in the same
compare-and-swap as the ledger, before any pod is told of them, so a restarted operator or a peer accounts
for every lease that may be in use. A pod whose counters began again (a new epoch), or that ended without a
final reading, may have spent its whole outstanding lease unread: that is counted against the budget
(`lost`) for the period.

Allowance goes where requests wait for it. A pod that cannot fit a request its tenant's budget covers holds
it and asks at once (tally_runtime/budgets.py): its /metrics and a long-poll the operator keeps open say how
much its waiting requests need, and the operator runs a round then rather than at the next scrape. The round
grants the asks first, on top of what the pod holds and past any cap (a request that fits what the tenant
has left is served; a pod whose ask cannot be met gives up what it holds to one whose ask can). The rest is
headroom by demand (as much again as asked, twice what the pod spent since the round before), at most the
budget divided by the serving pods per pod (what a pod that ends unread takes with it). A pod holding more
than its part is sent a lower allowance, but the status keeps counting the higher one (the pod may be spending
under it) until the pod's /metrics show it applied that message (its `seq`, numbered above every earlier one)
and what it may still reach under it: only then is the difference free to lease elsewhere. So an idle pod never
keeps a budget from the pods where its tenant is asking, and a lease entry with nothing held or asked goes.

With a default budget, a tenant the ledger does not know yet has spent nothing: a pod holds its request and
asks, and the round leases it like any other. Rate limits are per pod: each gets an equal share of a tenant's
tokens per minute.
"""

from __future__ import annotations

import calendar
import datetime
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from tally_operator.samples import Counters
from tally_operator.shards import MAX_SHARD_TENANTS, SHARDS
from tally_operator.usage import MAX_LEDGER_TENANTS, Ledger, Reading
from tally_runtime.contract import OTHER_TENANT
from tally_runtime.units import Weights, label_weights, message_unit

WARN_AT = 0.8  # an Event when a tenant's spend crosses this share of its budget, and at 100 %


@dataclass(frozen=True, slots=True)
class TenantBudget:
    monthly_tokens: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    count: str = "total"  # the unit (units.py): total | completion | prompt, or a credits label
    default: TenantBudget | None = None  # for tenants not listed
    tenants: Mapping[str, TenantBudget] = field(default_factory=dict)
    # Under a platform Budget (platform.py) the budgets above are this service's slices: what each tenant has
    # left across every covered service is told to the pods apart (a request larger is refused at once)
    anywhere: Mapping[str, int] = field(default_factory=dict)
    default_anywhere: int | None = None
    source: str = "spec"  # where the budgets come from: "spec" (spec.budgets) or "Budget/<name>"
    seq: int = 0  # under a Budget: the number of its slices planned with (the Budget counts a lower one from then)
    refused: str = ""  # why every tenant the budgets cover is refused (tenants not authenticated), if they are

    def of(self, tenant: str) -> TenantBudget | None:
        return self.tenants.get(tenant, self.default)


@dataclass(frozen=True, slots=True)
class PodLease:
    epoch: float
    allowances: Mapping[str, int]  # tenant -> the most the pod's counter may reach under any message it may apply
    starter: int | None = None  # the allowance of a tenant not listed: 0 (it asks for a lease), None (unlimited)
    seq: int = 0  # the number of the last message sent to the pod


@dataclass(frozen=True, slots=True)
class LeaseReport:
    """What a pod's /metrics say of its leases: the message it applied last, and per tenant the counter value
    it may still reach."""

    seq: int
    reach: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class BudgetState:
    """`status.budgets` as data."""

    period: str = ""  # YYYY-MM (UTC)
    start: Mapping[str, int] = field(default_factory=dict)  # tenant -> counted ledger total when the period began
    lost: Mapping[str, int] = field(default_factory=dict)  # tenant -> leases that ended unread this period
    leases: Mapping[str, PodLease] = field(default_factory=dict)  # pod uid -> its lease
    seq: int = 0  # the number of the last lease messages sent
    count: str = ""  # the count in force this period (a change in the spec applies from the next period)


UNTRACKED_LEDGER = "the service's ledger cannot keep this tenant apart (its part of the books is full)"
UNTRACKED_PLAN = "the budgets plan at most {} tenants a service"


@dataclass(frozen=True, slots=True)
class TenantView:
    budget: int
    spent: int
    reserved: int  # what pods may still spend under their leases (and ended pods may have, unread)
    remaining: int
    tokens_per_minute: int | None
    unspent: int = 0  # the budget less what was spent and lost: what the pods' leases share
    asked: int = 0  # what the pods' waiting requests asked for and this round could not grant
    lost: int = 0  # leases of pods that ended unread this period


@dataclass(frozen=True, slots=True)
class Planned:
    state: BudgetState
    tenants: Mapping[str, TenantView]
    messages: Mapping[str, dict[str, object]]  # pod uid -> the lease message to post (after the write lands)
    crossed: tuple[tuple[str, float], ...] = ()  # (tenant, threshold) crossed by this round
    pending_count: str = ""  # the spec's count, when it is not the one in force (it applies next period)
    source: str = "spec"  # the budgets' (BudgetConfig.source)


def counted(counters: Counters | None, count: str) -> int:
    """A tenant's counters in a budget's unit (`count`: a count's name, or a credits label: units.py)."""
    if counters is None:
        return 0
    return int(_weights(count).of(int(counters.prompt_tokens), int(counters.cached_tokens),
                                  int(counters.completion_tokens)))


@functools.lru_cache(maxsize=64)
def _weights(count: str) -> Weights:
    return label_weights(count)


def is_unit(label: str) -> bool:
    try:
        label_weights(label)
    except ValueError:
        return False
    return True


def period_of(now: datetime.datetime) -> tuple[str, float]:
    """The UTC calendar month `now` is in, and when it ends (unix seconds)."""
    last_day = calendar.monthrange(now.year, now.month)[1]
    end = datetime.datetime(now.year, now.month, last_day, tzinfo=datetime.UTC) + datetime.timedelta(days=1)
    return f"{now.year:04d}-{now.month:02d}", end.timestamp()


def plan_budgets(config: BudgetConfig, before: Ledger, after: Ledger, state: BudgetState,
                 serving: frozenset[str], now: datetime.datetime,
                 wanted: Mapping[str, Mapping[str, int]] | None = None,
                 reports: Mapping[str, LeaseReport] | None = None,
                 room: Callable[[str], bool] | None = None) -> Planned:
    """The budgets after a booked round: leases to keep and send, and what each tenant has left. `room`: whether
    the ledger can keep a tenant it does not hold yet apart (default: the ledger holds fewer than its bound).

    The invariant, per tenant, after every round (tests/unit/operator/test_budget.py checks at every step that
    no tenant spends past its budget while pods die, restart and miss scrapes):

        spent this period + Σ over pods max(0, what the pod may reach - its reading) + lost this period <= budget

    where what a pod may reach is the highest allowance of any message it may still apply (a lower one counts
    only once its /metrics show it applied it)."""
    if room is None:
        room = lambda _tenant: not _ledger_full(after)  # noqa: E731
    period, period_end = period_of(now)
    start, lost = dict(state.start), dict(state.lost)
    wanted_count = config.count
    if state.period != period:  # a new month: spend counts from here, in the spec's count
        start = {t: counted(c, config.count) for t, c in after.tenants.items()}
        lost = {}
    elif state.count and state.count != config.count:
        # the month's start and what was lost are in the count in force: a change applies from the next month
        config = replace(config, count=state.count)
    wanted, reports = wanted or {}, reports or {}
    asked = {t for tenants in wanted.values() for t in tenants}
    known = set(after.tenants) | asked | {t for lease in state.leases.values() for t in lease.allowances}
    # Fail closed: a tenant whose spend the ledger cannot keep apart (it would be booked to `other`) or that the
    # plan cannot hold is never granted anything; its pods refuse it, saying why (never a fresh allowance)
    untracked = dict.fromkeys(sorted(t for t in known | set(config.tenants)
                                     if t != OTHER_TENANT and t not in after.tenants and not room(t)),
                              UNTRACKED_LEDGER)
    # The spec's own tenants first (never cut by names a pod asks for), then the others a default covers
    listed = sorted(t for t in config.tenants if t not in untracked)
    others = sorted(t for t in (known if config.default is not None else set()) - set(config.tenants)
                    if t not in untracked)
    budgeted = (listed + others)[:MAX_ENTRIES]
    untracked.update(dict.fromkeys((listed + others)[MAX_ENTRIES:], UNTRACKED_PLAN.format(MAX_ENTRIES)))
    if config.refused:  # nothing the budgets cover is served, and the pods are told why
        untracked.update(dict.fromkeys(budgeted, config.refused))
        budgeted = []
    leases = dict(state.leases)
    # Leases of pods that left the ledger or began again: what they may have spent unread is lost for the period
    for uid, lease in sorted(state.leases.items()):
        reading = after.readings.get(uid)
        if reading is not None and reading.epoch == lease.epoch:
            continue
        last = before.readings.get(uid)
        if reading is None and last is not None and last.final and last.epoch == lease.epoch:
            del leases[uid]  # ended with its final counters read: nothing spent unread
            continue
        for tenant in budgeted:
            unread = _outstanding(lease, last if last is not None and last.epoch == lease.epoch else None,
                                  tenant, config.count)
            if unread:
                lost[tenant] = lost.get(tenant, 0) + unread
        del leases[uid]
    # What each pod may reach: as recorded, or less where its /metrics show it applied our last message
    leases = {uid: confirmed_lease(lease, after.readings.get(uid), reports.get(uid)) for uid, lease in leases.items()}
    views: dict[str, TenantView] = {}
    grants: dict[str, dict[str, int]] = {uid: {} for uid in sorted(serving) if uid in after.readings}
    counts: dict[str, dict[str, int]] = {uid: {} for uid in grants}  # what the status keeps counting
    for tenant in budgeted:
        budget = config.of(tenant)
        if budget is None or budget.monthly_tokens is None:
            continue
        spent = max(0, counted(after.tenants.get(tenant), config.count) - start.get(tenant, 0))
        outstanding = {uid: _outstanding(lease, after.readings.get(uid), tenant, config.count)
                       for uid, lease in leases.items()}
        held = sum(outstanding.values()) + lost.get(tenant, 0)
        unspent = max(0, budget.monthly_tokens - spent - lost.get(tenant, 0))
        free = max(0, budget.monthly_tokens - spent - held)
        # Only where the tenant is active (counted, asked for, or leased already): the status stays small
        active = [uid for uid in sorted(grants) if _active(uid, tenant, after.readings[uid], leases, wanted)]
        used = {uid: _used(after.readings[uid], tenant, config.count) for uid in active}
        asks = {uid: wanted.get(uid, {}).get(tenant, 0) for uid in active}
        recent = {uid: max(0, used[uid] - _used(before.readings.get(uid), tenant, config.count)) for uid in active}
        elsewhere = sum(v for uid, v in outstanding.items() if uid not in used)
        targets = shares(unspent - elsewhere, budget.monthly_tokens // max(1, len(grants)),
                         {uid: (outstanding.get(uid, 0), asks[uid], recent[uid]) for uid in active})
        for uid in active:  # takings back first: they free nothing until confirmed, but must not be given twice
            have = outstanding.get(uid, 0)
            if have > targets[uid]:
                grants[uid][tenant], counts[uid][tenant] = used[uid] + targets[uid], used[uid] + have
        # Then what is free, to the pods whose requests wait for it first (the largest ask first), then the rest
        for uid in sorted(active, key=lambda u: (-asks[u], u)):
            if tenant in grants[uid]:
                continue
            have = outstanding.get(uid, 0)
            more = min(targets[uid] - have, free)
            free -= more
            held += more
            if not have and not more and not asks[uid]:
                continue  # nothing held or asked for here: the entry goes (the status stays small; it reads as 0)
            grants[uid][tenant] = counts[uid][tenant] = used[uid] + have + more
        unmet = sum(max(0, asks[uid] - grants[uid].get(tenant, 0) + used[uid] + outstanding.get(uid, 0))
                    for uid in active if asks[uid])
        views[tenant] = TenantView(budget.monthly_tokens, spent, held, max(0, budget.monthly_tokens - spent - held),
                                   budget.tokens_per_minute, unspent, unmet, lost.get(tenant, 0))
    starter = 0 if config.default is not None else None  # a tenant not listed asks for a lease
    seq = max(state.seq + 1, int(now.timestamp() * 1000)) if grants else state.seq  # above any sent before
    messages: dict[str, dict[str, object]] = {}
    for uid, allowances in grants.items():
        reading = after.readings[uid]
        assert reading.epoch is not None
        # Kept: the most the pod may reach (a message not applied yet may still raise it to the new count)
        kept = {t: max(v, leases[uid].allowances.get(t, 0) if uid in leases and leases[uid].epoch == reading.epoch
                       else 0) for t, v in counts[uid].items()}
        leases[uid] = PodLease(reading.epoch, kept, starter, seq)
        messages[uid] = _message(uid, reading.epoch, seq, config, allowances, starter, len(grants), period_end,
                                 views, {t: why for t, why in untracked.items()
                                         if t in config.tenants or t in wanted.get(uid, {})})
    crossed = tuple((tenant, mark) for tenant, view in views.items() for mark in (WARN_AT, 1.0)
                    if config.source == "spec"  # a Budget's slices are no budget: the Budget's own round says
                    and _spent_before(state, before, tenant, config) < mark * view.budget <= view.spent)
    return Planned(BudgetState(period, start, lost, leases, seq, config.count), views, messages, crossed,
                   wanted_count if wanted_count != config.count else "", config.source)


def shares(pool: int, cap: int, pods: Mapping[str, tuple[int, int, int]]) -> dict[str, int]:
    """What each pod where a tenant is active should hold of `pool` (what the tenant has left, less what pods
    elsewhere hold), given per pod (what it holds, what its waiting requests ask for, what it spent since the
    round before).

    The asks come first, the largest first: what the pod holds and what it asks for, as far as the pool goes
    and whatever the cap (a request that fits what the tenant has left is served; a pod whose ask the pool
    cannot meet gives up what it holds to the one that can). What is left is headroom, so that a busy pod need
    not ask for every request: by demand, as much again as it asks for and twice what it spent since the round
    before (an idle pod's is 0: what it holds is taken back for the pods that ask), and at most `cap` (the
    budget divided by the serving pods): what a pod that ends unread takes with it."""
    targets: dict[str, int] = {}
    left = max(0, pool)
    for uid in sorted((u for u, (_, ask, _) in pods.items() if ask), key=lambda u: (-pods[u][1], u)):
        have, ask, _ = pods[uid]
        targets[uid] = min(have + ask, left)
        left -= targets[uid]
    demand = {uid: 1 + ask + recent for uid, (_, ask, recent) in pods.items()}
    total = sum(demand.values())
    for uid, (_, ask, recent) in pods.items():
        targets[uid] = targets.get(uid, 0) + min(cap, left * demand[uid] // total, ask + 2 * recent)
    return targets


def _used(reading: Reading | None, tenant: str, count: str) -> int:
    return counted(reading.tenants.get(tenant) if reading is not None and reading.tenants else None, count)


def confirmed_lease(lease: PodLease, reading: Reading | None, report: LeaseReport | None) -> PodLease:
    """The lease as the status counts it, lowered to what the pod reports it may reach once it applied the
    last message sent to it (it applies none older than that, and no newer one exists)."""
    if report is None or reading is None or reading.epoch != lease.epoch or report.seq != lease.seq or not lease.seq:
        return lease
    lowered = {t: min(v, report.reach[t]) if t in report.reach else v for t, v in lease.allowances.items()}
    return replace(lease, allowances=lowered)


def _outstanding(lease: PodLease, reading: Reading | None, tenant: str, count: str) -> int:
    """What the pod may still spend for `tenant` beyond its reading (its whole lease without a reading)."""
    allowance = lease.allowances.get(tenant, lease.starter or 0)
    if reading is None:
        return allowance
    if reading.epoch != lease.epoch:
        return 0
    used = counted(reading.tenants.get(tenant) if reading.tenants else None, count)
    return max(0, allowance - used)


def _active(uid: str, tenant: str, reading: Reading, leases: Mapping[str, PodLease],
            wanted: Mapping[str, Mapping[str, int]]) -> bool:
    lease = leases.get(uid)
    return bool(reading.tenants and tenant in reading.tenants) or tenant in wanted.get(uid, {}) or \
        (lease is not None and lease.epoch == reading.epoch and tenant in lease.allowances)


def _message(uid: str, epoch: float, seq: int, config: BudgetConfig, allowances: Mapping[str, int],
             starter: int | None, pods: int, period_end: float, views: Mapping[str, TenantView],
             untracked: Mapping[str, str]) -> dict[str, object]:
    """What the pod is told: every tenant it has an allowance for, every listed tenant (one with a budget but
    no allowance here gets 0 and asks), what a tenant not listed gets (`starter`), and the tenants it asked for
    or lists whose books cannot be kept (refused, with why). A listed tenant never gets `allowance: None`."""
    def rate(tenant: str | None) -> int | None:
        budget = config.of(tenant) if tenant is not None else config.default
        return None if budget is None or budget.tokens_per_minute is None else budget.tokens_per_minute // pods

    tenants: dict[str, dict[str, int | str | None]] = {}
    for tenant in sorted(set(allowances) | set(config.tenants) | set(untracked)):
        view = views.get(tenant)
        if tenant in untracked:
            tenants[tenant] = {"allowance": 0, "tokensPerMinute": rate(tenant), "unspent": 0,
                               "untracked": untracked[tenant]}
            continue
        budget = config.of(tenant)
        listed = budget is not None and budget.monthly_tokens is not None
        allowance = allowances.get(tenant, 0 if view is not None or listed else None)
        tenants[tenant] = {"allowance": allowance, "tokensPerMinute": rate(tenant),
                           "unspent": _anywhere(config, tenant, view)}
    return {"podUid": uid, "epoch": epoch, "seq": seq, **message_unit(config.count), "periodEnd": period_end,
            "tenants": tenants,
            "starter": {"allowance": starter, "tokensPerMinute": rate(None),
                        **({"untracked": config.refused} if config.refused and starter is not None else {})}}


def _anywhere(config: BudgetConfig, tenant: str, view: TenantView | None) -> int | None:
    """What the tenant has left wherever it may spend: its budget here, or under a platform Budget what it has
    left across the covered services (never less than what this service's slice has left)."""
    here = view.unspent if view is not None else None
    there = config.anywhere.get(tenant, config.default_anywhere if tenant not in config.tenants else None)
    if there is None:
        return here
    return there if here is None else max(here, there)


def _ledger_full(ledger: Ledger) -> bool:
    return len(ledger.tenants) - (OTHER_TENANT in ledger.tenants) >= MAX_LEDGER_TENANTS


def _spent_before(state: BudgetState, before: Ledger, tenant: str, config: BudgetConfig) -> int:
    if not state.period:
        return 0
    return max(0, counted(before.tenants.get(tenant), config.count) - state.start.get(tenant, 0))


def budgets_status(planned: Planned, config: BudgetConfig) -> dict[str, object]:
    """`status.budgets`: what each tenant has left, and the leases and period totals they stand on."""
    state = planned.state
    return {
        "period": state.period, "count": state.count or config.count,
        **({"pendingCount": planned.pending_count} if planned.pending_count else {}),
        "tenants": {t: {"budget": v.budget, "spent": v.spent, "reserved": v.reserved, "remaining": v.remaining,
                        "unspent": v.unspent, **({"asked": v.asked} if v.asked else {}),
                        **({"lost": v.lost} if v.lost else {}),
                        **({"tokensPerMinute": v.tokens_per_minute} if v.tokens_per_minute is not None else {})}
                    for t, v in sorted(planned.tenants.items())},
        "periodStart": dict(sorted(state.start.items())),
        "lost": dict(sorted(state.lost.items())),
        "leases": [{"uid": uid, "epoch": lease.epoch, "seq": lease.seq,
                    "tenants": dict(sorted(lease.allowances.items())),
                    **({"starter": lease.starter} if lease.starter is not None else {})}
                   for uid, lease in sorted(state.leases.items())],
        "seq": state.seq,
        "source": config.source, **({"budgetSeq": config.seq} if config.source != "spec" else {}),
    }


def state_from_status(raw: Mapping[str, object]) -> BudgetState:
    """The budgets as the last status write left them (anything malformed reads as absent: refusing is then
    the runtime's default, as no lease is granted from nothing)."""
    def counts(value: object) -> dict[str, int]:
        if not isinstance(value, Mapping):
            return {}
        return {str(k): v for k, v in list(value.items())[:MAX_ENTRIES]
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0}

    leases: dict[str, PodLease] = {}
    raw_leases = raw.get("leases")
    for item in raw_leases[:MAX_ENTRIES] if isinstance(raw_leases, list) else []:
        if isinstance(item, Mapping) and isinstance(item.get("uid"), str) and \
                isinstance(item.get("epoch"), int | float) and not isinstance(item.get("epoch"), bool):
            starter, seq = item.get("starter"), item.get("seq")
            leases[str(item["uid"])] = PodLease(float(item["epoch"]), counts(item.get("tenants")),
                                                starter if isinstance(starter, int) and starter >= 0 else None,
                                                seq if isinstance(seq, int) and not isinstance(seq, bool) else 0)
    period, seq, count = raw.get("period"), raw.get("seq"), raw.get("count")
    return BudgetState(period if isinstance(period, str) else "", counts(raw.get("periodStart")),
                       counts(raw.get("lost")), leases,
                       seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0,
                       count if isinstance(count, str) and is_unit(count) else "")


# Tenants planned, or leases read, per service: as many as its shards hold (shards.py); beyond, refused
MAX_ENTRIES = SHARDS * MAX_SHARD_TENANTS
