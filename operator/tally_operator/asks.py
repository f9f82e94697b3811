"""I/O: has a pod of this service a request waiting for budget allowance (or is it waiting for its first lease)?
The operator's long-poll of the runtimes' `GET /internal/budgets/asks` (tally_runtime/budgets.py): the first
pod that answers with a waiting request ends it, and the caller runs a round at once instead of at the next
scrape (budget.py grants what is asked). Only the pods the service owns and budgets lease to are asked; what
they answer only starts a round (which reads them again), so a wrong answer costs a round, never a token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

from tally_operator import constants as c
from tally_operator.children import read_children
from tally_operator.context import Context
from tally_operator.pods import leasable_uids
from tally_operator.scrape import scrape
from tally_operator.usage import pod_url
from tally_runtime.contract import BUDGET_ASKS_PATH

MAX_ASKS_BYTES = 256 << 10  # 1,000 tenants' asks, with room


def asking(text: str) -> bool:
    """PURE: whether an answer says a request waits for allowance there, or the pod waits for its first lease."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return False
    if not isinstance(answer, Mapping):
        return False
    waiting = answer.get("waiting")
    return answer.get("leased") is False or (isinstance(waiting, Mapping) and bool(waiting))


async def asked(ctx: Context, meta: Mapping[str, str], wait: float) -> bool:
    """Long-poll the service's leasable pods for at most `wait` seconds: True as soon as one is asking."""
    _, pods = await asyncio.to_thread(read_children, ctx, meta)
    uids = leasable_uids(pods)
    urls = {p["metadata"]["uid"]: pod_url(p["status"]["podIP"], c.RUNTIME_METRICS_PORT,
                                          f"{BUDGET_ASKS_PATH}?wait={wait:g}")
            for p in pods if p["metadata"]["uid"] in uids}
    if not urls:
        return False
    tasks = [asyncio.create_task(scrape({uid: url}, ctx.settings.scrape_concurrency,
                                        ctx.settings.scrape_timeout + wait, max_bytes=MAX_ASKS_BYTES))
             for uid, url in sorted(urls.items())]
    try:
        for done in asyncio.as_completed(tasks):
            result = next(iter((await done).values()))
            if isinstance(result, str) and asking(result):
                return True
        return False
    finally:
        for task in tasks:
            task.cancel()
