"""A runtime's counters for the ledger's unit tests: totals and per tenant under one epoch, as its /metrics
would show them."""

from __future__ import annotations

from tally_operator.samples import Counters, PodSample


class Pod:
    def __init__(self, uid: str = "", epoch: float = 1.0) -> None:
        self.uid, self.epoch = uid, epoch
        self.tenants: dict[str, Counters] = {}

    def serve(self, tenant: str, prompt: int, completion: int, cached: int = 0) -> Counters:
        served = Counters(requests=1, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
        self.tenants[tenant] = self.tenants.get(tenant, Counters()).plus(served)
        return served

    def sample(self, final: bool = False) -> PodSample:
        totals = Counters()
        for counters in self.tenants.values():
            totals = totals.plus(counters)
        return PodSample(totals, "incremental", None, self.epoch, final, dict(self.tenants), pod_uid=self.uid)
