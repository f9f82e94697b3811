"""`python -m tally_operator` / `tally-operator`: kopf run with our handlers and settings."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tally-operator", description="Reconcile CompletionService resources.")
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: the whole cluster")
    parser.add_argument("--standalone", action="store_true", help="run without peering (one instance only)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority: the highest live one works, the others stand by (default: random, "
                             "so that replicas never tie; peers of equal priority all pause)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a scrape of every pod every interval. INFO says what changed.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))

    import kopf

    import tally_operator.handlers  # noqa: F401  (registers the handlers)

    asyncio.run(kopf.operator(
        clusterwide=not args.namespace, namespaces=args.namespace, standalone=args.standalone,
        liveness_endpoint=args.liveness,
        priority=args.priority if args.priority is not None else random.randint(1, 2**31 - 1),
    ))


if __name__ == "__main__":
    main()
