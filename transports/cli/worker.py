"""``tokcap worker``: a pool of rebuild workers on the Redis job stream.

Start one process per core and give each ``--concurrency`` tasks; every process joins the
same consumer group, so scaling out is starting another one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from transports.rebuild.worker import RebuildWorker, WorkerSettings, run_worker

DEFAULT_URL = os.environ.get("TOKCAP_REDIS_URL", "redis://127.0.0.1:6379/0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerSettings(consumer="-")
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="Redis URL (rediss:// for TLS; default $TOKCAP_REDIS_URL or %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=defaults.concurrency,
        help="jobs rebuilt at once in this process (default %(default)s)",
    )
    parser.add_argument(
        "--group",
        default=defaults.group,
        help="consumer group, one per service (default %(default)s)",
    )
    parser.add_argument(
        "--consumer", default=None, help="this worker's name in the group (default <host>-<pid>)"
    )
    parser.add_argument(
        "--claim-idle-ms",
        type=int,
        default=defaults.claim_idle_ms,
        help="take over jobs idle this long from dead workers (default %(default)s)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=defaults.max_attempts,
        help="attempts before a job goes to the dead-letter stream (default %(default)s)",
    )
    parser.add_argument(
        "--key-prefix",
        default=defaults.key_prefix,
        help="prefix of the store's keys and of the streams (default %(default)s)",
    )
    parser.add_argument(
        "--durability",
        default=defaults.durability,
        help="fsync | replicas:N | none, as for the store (default %(default)s)",
    )
    parser.add_argument(
        "--block-ms",
        type=int,
        default=defaults.block_ms,
        help="how long one read waits for new jobs (default %(default)s)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    extra = {"consumer": args.consumer} if args.consumer else {}
    return WorkerSettings(
        url=args.url,
        key_prefix=args.key_prefix,
        group=args.group,
        concurrency=args.concurrency,
        claim_idle_ms=args.claim_idle_ms,
        max_attempts=args.max_attempts,
        block_ms=args.block_ms,
        durability=args.durability,
        **extra,
    )


def run(
    args: argparse.Namespace,
    worker_type: Callable[[WorkerSettings], RebuildWorker] = RebuildWorker,
) -> int:
    """Run a worker from parsed flags; ``worker_type`` is for tests (see ``run_worker``)."""
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"tokcap worker: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("tokcap.worker").info(
        "worker %s: %s, group %s, concurrency %d",
        settings.consumer,
        settings.jobs_stream,
        settings.group,
        settings.concurrency,
    )
    try:
        counts = asyncio.run(run_worker(settings, worker_type))
    except Exception as exc:  # startup errors (durability, unreachable Redis) end the process
        print(f"tokcap worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("tokcap.worker").info("worker stopped: %s", counts)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokcap worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
