"""What every pass shares and remembers: the operator's `Context` (built once at start-up) and each resource's
`ServiceMemory` (this process's memory of one CompletionService between passes: never its ledger, which is read
from the status every time), and the data a scrape round hands between the pass's steps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from tally_operator.activation import Held
from tally_operator.autoscale import (
    Decision,
    Observation,
    Recommendation,
)
from tally_operator.collector import Forwarder
from tally_operator.kube import Kube
from tally_operator.metrics import OperatorMetrics
from tally_operator.observations import Observations
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer
from tally_operator.spec import SpecError
from tally_operator.usage import (
    Round,
)

Post = Callable[[Any, str, str, str], None]  # (body, type, reason, message): an Event on the resource

def kopf_event(body: Any, kind: str, reason: str, message: str) -> None:
    kopf.event(body, type=kind, reason=reason[:128], message=message[:1024])

@dataclass
class Context:
    """What every pass shares, built once when the operator starts."""

    settings: OperatorSettings
    kube: Kube
    metrics: OperatorMetrics
    signer: Signer
    post_event: Post = kopf_event
    forwarder: Forwarder | None = None  # the platform's record delivery, when its billing system is configured
    # Wake-ups between the daemons of this process: a Budget whose services ask for more, a service whose slices
    # changed. Keyed by (kind, name) for a Budget, (namespace, name) for a service.
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    budget_generations: dict[str, int] = field(default_factory=dict)  # a Budget's spec as its round last saw it

    def wakeup(self, key: tuple[str, str]) -> asyncio.Event:
        """The event a daemon waits on (made on first use; cleared by the one that waits)."""
        return self.wakeups.setdefault(key, asyncio.Event())

    def wake(self, key: tuple[str, str]) -> None:
        self.wakeup(key).set()

    def budget_edited(self, name: str, generation: object) -> None:
        """A Budget was seen at `generation`: its round runs at once when the spec changed (a raise reaches
        the services in about a second, not at the round's next turn); a status write changes no generation."""
        if isinstance(generation, int) and self.budget_generations.get(name) != generation:
            self.budget_generations[name] = generation
            self.wake(("Budget", name))

@dataclass
class ServiceMemory:
    """What this process remembers about one CompletionService between passes (never the ledger itself:
    that is read from the status every time)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one pass at a time per resource
    scraped_at: float = -1e9  # monotonic time of the last scrape round
    scrape_now: bool = False  # a pod asks for budget allowance: the next pass scrapes whenever the last was
    observations: Observations = field(default_factory=Observations)
    apply_error: SpecError | None = None  # the API server's refusal, until a pass applies cleanly
    refused: dict[str, str] = field(default_factory=dict)  # pod uid -> why its last sample was refused
    left_out: dict[str, str] = field(default_factory=dict)  # pod uid -> why its last round was left for later
    records_lost: dict[str, int] = field(default_factory=dict)  # pod uid -> its records lost, as last read
    budget_notice: str = ""  # the budgets' count change announced last (an Event once, not every round)
    spec_budgets_noted: bool = False  # spec.budgets' deprecation said (an Event once per process)
    budgeted: bool = False  # the last pass planned budgets: its pods' asks are long-polled (handlers.py)
    scaling: Scaling = field(default_factory=lambda: Scaling())

@dataclass
class Scaling:
    """Autoscaling's memory: the signal's recent history and recommendations (never the count: that is the
    Deployment's, read every pass). A restarted operator, a peer taking over, or one that resumes after a
    pause longer than the stable window starts afresh: no scale-down until it has watched for a whole
    scale-down delay."""

    since: float = field(default_factory=time.monotonic)
    history: tuple[Observation, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()
    last_scale_time: str | None = None
    # scale to zero: when traffic was last seen (a restarted operator waits a whole grace), and each pod's
    # request counter as last read (a change is traffic)
    active_at: float = field(default_factory=time.monotonic)
    requests_seen: Mapping[str, float] = field(default_factory=dict)

@dataclass(frozen=True)
class Scraped:
    round: Round
    urls: Mapping[str, str]  # pod uid -> the base URL it was reached at
    refused: Mapping[str, str]  # pod uid -> why its /metrics were not trusted this round
    decision: Decision | None = None  # autoscaling's, on this round's signal
    scaling: Scaling | None = None  # the memory to keep once the status holding the decision has landed
    held: Held | None = None  # scale to zero: what the activator holds (None: no activator read)
