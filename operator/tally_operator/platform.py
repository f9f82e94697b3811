"""PURE: the platform's budgets (the cluster-scoped `Budget` resource) as data, which services each covers, and
what one service plans with under the budget that covers it (its slice of each tenant's month, slices.py).

A Budget is the platform team's, not the serving team's: a role on a serving namespace cannot write one. It
covers the CompletionServices of its namespaces (only the named ones, and only those whose labels match, when
given); a service two budgets cover follows the older one (then the name decides), and the other says so. The
service's own `spec.budgets` still applies where no Budget covers it (deprecated: an Event says so), and never
where one does: a serving team cannot raise what the platform set."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tally_operator.budget import BudgetConfig, TenantBudget
from tally_operator.conditions import Verdict
from tally_operator.constants import BUDGET_APPLIED
from tally_runtime.units import COUNTS, CREDITS, Weights, credits_label

MAX_PLATFORM_TENANTS = 1000  # as the CRD says


class BudgetSpecError(ValueError):
    """A Budget the operator cannot apply (the schema refuses it; this is for one read without the schema)."""


@dataclass(frozen=True, slots=True)
class PlatformBudget:
    name: str
    uid: str
    created: str  # creationTimestamp: the older of two budgets covering one service wins
    namespaces: frozenset[str]
    names: frozenset[str] = frozenset()  # empty: every service of the namespaces
    labels: Mapping[str, str] = field(default_factory=dict)  # every one must match, when given
    count: str = "total"  # the unit with tokens; with credits, "credits" (per service: unit_of)
    weights: Weights = COUNTS["total"]  # with credits: for a service not listed in service_weights
    service_weights: Mapping[tuple[str, str], Weights] = field(default_factory=dict)
    default: TenantBudget | None = None
    tenants: Mapping[str, TenantBudget] = field(default_factory=dict)
    status: Mapping[str, Any] = field(default_factory=dict)

    def covers(self, namespace: str, name: str, labels: Mapping[str, str]) -> bool:
        return namespace in self.namespaces and (not self.names or name in self.names) and \
            all(labels.get(k) == v for k, v in self.labels.items())

    def unit_of(self, namespace: str, name: str) -> str:
        """The unit label one covered service counts in (units.py): a count's name, or its credits."""
        if self.count != CREDITS:
            return self.count
        return credits_label(self.service_weights.get((namespace, name), self.weights))

    def limit(self, tenant: str) -> TenantBudget | None:
        return self.tenants.get(tenant, self.default)


def parse_budget(obj: Mapping[str, Any]) -> PlatformBudget:
    """A Budget object as data; BudgetSpecError for what the CRD's schema would have refused."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    services = spec.get("services") or {}
    namespaces = services.get("namespaces")
    if not isinstance(namespaces, list) or not namespaces or not all(isinstance(n, str) and n for n in namespaces):
        raise BudgetSpecError("spec.services.namespaces must name at least one namespace")
    names = services.get("names") or []
    labels = (services.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(names, list) or not isinstance(labels, Mapping):
        raise BudgetSpecError("spec.services.names must be a list and selector.matchLabels an object")
    unit = spec.get("unit", "tokens")
    if unit not in ("tokens", CREDITS):
        raise BudgetSpecError("spec.unit must be tokens or credits")
    count = str(spec.get("count") or "total") if unit == "tokens" else CREDITS
    if unit == "tokens" and count not in COUNTS:
        raise BudgetSpecError(f"spec.count must be one of {', '.join(COUNTS)}")
    credits = spec.get("credits") or {}
    weights = _weights(credits.get("weights") or {}, "spec.credits.weights")
    per_service = {}
    for i, item in enumerate(credits.get("services") or []):
        if not isinstance(item, Mapping) or not item.get("namespace") or not item.get("name"):
            raise BudgetSpecError(f"spec.credits.services[{i}] needs a namespace and a name")
        per_service[(str(item["namespace"]), str(item["name"]))] = _weights(item, f"spec.credits.services[{i}]")
    tenants: dict[str, TenantBudget] = {}
    listed = spec.get("tenants") or []
    if not isinstance(listed, list) or len(listed) > MAX_PLATFORM_TENANTS:
        raise BudgetSpecError(f"spec.tenants must be a list of at most {MAX_PLATFORM_TENANTS}")
    for i, item in enumerate(listed):
        name = item.get("name") if isinstance(item, Mapping) else None
        if not isinstance(name, str) or not name or name in tenants:
            raise BudgetSpecError(f"spec.tenants[{i}].name must be a tenant named once")
        tenants[name] = _limit(item, f"spec.tenants[{i}]")
    default = _limit(spec["default"], "spec.default") if spec.get("default") is not None else None
    return PlatformBudget(str(meta.get("name") or ""), str(meta.get("uid") or ""),
                          str(meta.get("creationTimestamp") or ""), frozenset(map(str, namespaces)),
                          frozenset(map(str, names)), {str(k): str(v) for k, v in labels.items()}, count, weights,
                          per_service, default, tenants, obj.get("status") or {})


def _weights(raw: Mapping[str, Any], where: str) -> Weights:
    values = [raw.get(k, 1) for k in ("prompt", "cachedPrompt", "completion")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1_000_000 for v in values):
        raise BudgetSpecError(f"{where}: weights are whole numbers from 0 to 1000000")
    return Weights(*values)


def _limit(raw: Any, where: str) -> TenantBudget:
    if not isinstance(raw, Mapping):
        raise BudgetSpecError(f"{where} must be an object")
    values = [raw.get("monthly"), raw.get("perMinute")]
    if all(v is None for v in values) or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53) for v in values):
        raise BudgetSpecError(f"{where} needs monthly, perMinute or both, whole numbers from 0 to 2^53")
    return TenantBudget(values[0], values[1])


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def covering(budgets: Iterable[PlatformBudget], namespace: str, name: str,
             labels: Mapping[str, str]) -> list[PlatformBudget]:
    """The budgets that cover a service, the one it follows first (the oldest; then by name)."""
    return sorted((b for b in budgets if b.covers(namespace, name, labels)), key=lambda b: (b.created, b.name))


def period_now(now: datetime.datetime) -> str:
    return f"{now.year:04d}-{now.month:02d}"


def slice_config(budget: PlatformBudget, namespace: str, name: str, uid: str, pods: int,
                 now: datetime.datetime) -> BudgetConfig:
    """What one covered service plans its pods' leases with: per tenant its slice of the month (what the budget's
    status grants it, spent included; 0 for a tenant it has none of yet: its pods ask, and the budget's next
    round grants), its part of the rate (by its share of the covered pods), and what the tenant has left across
    every covered service (a request larger than that is refused `insufficient_quota` at once)."""
    status = budget.status
    entry: Mapping[str, Any] = next((s for s in status.get("services") or []
                                     if isinstance(s, Mapping) and s.get("uid") == uid), {})
    slices: Mapping[str, Any] = _mapping(entry.get("tenants"))
    current = status.get("period") == period_now(now)
    views: Mapping[str, Any] = _mapping(status.get("tenants")) if current else {}
    total_pods = sum(int(s.get("pods") or 0) for s in status.get("services") or [] if isinstance(s, Mapping))
    share = (pods / total_pods) if total_pods > pods > 0 else 1.0

    def part(limit: TenantBudget, tenant: str | None) -> TenantBudget:
        rate = None if limit.tokens_per_minute is None else int(limit.tokens_per_minute * share)
        if limit.monthly_tokens is None:
            return TenantBudget(None, rate)
        granted = (slices.get(tenant) or {}).get("granted") if tenant is not None else None
        return TenantBudget(granted if isinstance(granted, int) and granted >= 0 else 0, rate)

    tenants = {t: part(limit, t) for t, limit in budget.tenants.items()}
    if budget.default is not None:  # tenants not listed that hold a slice here
        for tenant in slices:
            if tenant not in tenants:
                tenants[str(tenant)] = part(budget.default, str(tenant))
    anywhere = {}
    for tenant in tenants.keys() | (set(slices) if budget.default is not None else set()):
        limit = budget.limit(tenant)
        if limit is None or limit.monthly_tokens is None:
            continue
        view = views.get(tenant) if isinstance(views.get(tenant), Mapping) else None
        unspent = view.get("unspent") if view is not None else None
        anywhere[tenant] = unspent if isinstance(unspent, int) and unspent >= 0 else limit.monthly_tokens
    default = part(budget.default, None) if budget.default is not None else None
    return BudgetConfig(budget.unit_of(namespace, name), default, tenants, anywhere=anywhere,
                        default_anywhere=budget.default.monthly_tokens if budget.default is not None else None)


UNAUTHENTICATED = ("its tenants are not authenticated (the service has no spec.auth.apiKeysSecret): a client "
                   "could name any tenant, so Budget {} serves nothing it covers here")


def budgets_in_force(spec_budgets: BudgetConfig | None, authenticated: bool, namespace: str, name: str, uid: str,
                     labels: Mapping[str, str], platform: Iterable[PlatformBudget], pods: int,
                     now: datetime.datetime) -> tuple[BudgetConfig | None, Verdict | None]:
    """The budgets one service plans with, and its BudgetApplied condition: the oldest Budget that covers it (its
    slices; every covered tenant refused where tenants are not authenticated), else its own spec.budgets
    (deprecated), else none."""
    found = covering(platform, namespace, name, labels)
    if found:
        budget = found[0]
        config = slice_config(budget, namespace, name, uid, pods, now)
        config = replace(config, source=f"Budget/{budget.name}", seq=_seq(budget.status))
        also = [f"; Budget {b.name} also covers it and is not applied (the older one is)" for b in found[1:2]]
        ignored = "; its spec.budgets is ignored" if spec_budgets is not None else ""
        if not authenticated:
            return replace(config, refused=UNAUTHENTICATED.format(budget.name)), Verdict(
                BUDGET_APPLIED, "False", "TenantsNotAuthenticated",
                f"Budget {budget.name} covers this service, but {UNAUTHENTICATED.format(budget.name)}")
        return config, Verdict(BUDGET_APPLIED, "True", "PlatformBudget",
                               f"Budget {budget.name} covers this service{''.join(also)}{ignored}")
    if spec_budgets is not None:
        return spec_budgets, Verdict(BUDGET_APPLIED, "True", "SpecBudgets",
                                     "spec.budgets applies (deprecated: the platform team's Budget resource "
                                     "replaces it, and a Budget covering this service overrides it)")
    return None, None


def _seq(status: Mapping[str, Any]) -> int:
    seq = status.get("seq")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0
