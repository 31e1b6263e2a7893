"""``tokcap worker``: a pool of rebuild workers on the Redis job stream.

Start one process per core and give each ``--concurrency`` tasks; every process joins the
same consumer group, so scaling out is starting another one. ``--metrics-port`` (or
``TOKCAP_WORKER_METRICS_PORT``) serves the process's Prometheus metrics, on 127.0.0.1 unless
``--metrics-host`` says otherwise; several processes on one host each take their own port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from capture.build.segments import DELIVERIES
from tokcap.commands.redis_url import add_cluster_argument, add_url_argument, redis_url
from tokcap.help import verb_main
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker, run_worker

# The port of the worker's metrics when --metrics-port is not given (none: not served).
METRICS_PORT_ENV = "TOKCAP_WORKER_METRICS_PORT"

# Flags that set one WorkerSettings field each, in --help order, with what the field means;
# the flag is the field's name with dashes, and its type and default are the field's.
SETTING_FLAGS = {
    "concurrency": "jobs rebuilt at once in this process",
    "group": "consumer group, one per service",
    "claim_idle_ms": "take over jobs idle this long from dead workers",
    "max_attempts": "attempts before a job goes to the dead-letter stream",
    "key_prefix": "prefix of the store's keys and of the streams",
    "durability": "fsync | replicas:N | none, as for the store",
    "block_ms": "how long one read waits for new jobs",
    "shards": "job and result streams; submitters and trainers must use as many",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerSettings(url="", consumer="-")  # read for the flags' defaults only
    add_url_argument(parser)
    add_cluster_argument(parser)
    for name, meaning in SETTING_FLAGS.items():
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{meaning} (default %(default)s)",
        )
    parser.add_argument(
        "--delivery",
        choices=DELIVERIES,
        default="chain",
        help="deliver the main chain only, or every chain (the others as labelled segments "
        "under _ng_token_segments); default chain",
    )
    parser.add_argument(
        "--min-delivered-fraction",
        type=float,
        default=None,
        metavar="F",
        help="mask a rollout that delivers less than this share of what it sampled "
        "(default: none, no such mask)",
    )
    parser.add_argument(
        "--consumer", default=None, help="this worker's name in the group (default <host>-<pid>)"
    )
    add_metrics_arguments(parser, defaults)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default %(default)s)",
    )


def port_number(text: str) -> int:
    """A TCP port, from the flag or the environment; the error names both."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port (0-65535; from --metrics-port or ${METRICS_PORT_ENV})"
        )
    return port


def add_metrics_arguments(parser: argparse.ArgumentParser, defaults: WorkerSettings) -> None:
    """Where the Prometheus metrics are served: nowhere unless a port is named."""
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=os.environ.get(METRICS_PORT_ENV) or None,  # argparse converts it with type
        metavar="PORT",
        help=f"serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
        f"default ${METRICS_PORT_ENV}, else not served)",
    )
    parser.add_argument(
        "--metrics-host",
        default=defaults.metrics_host,
        metavar="HOST",
        help="address the metrics listen on (default %(default)s; 0.0.0.0 in a container "
        "that Prometheus scrapes from another)",
    )


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    chosen = {name: getattr(args, name) for name in SETTING_FLAGS}
    chosen["metrics_port"] = args.metrics_port
    chosen["metrics_host"] = args.metrics_host
    chosen["delivery"] = args.delivery
    chosen["min_delivered_fraction"] = args.min_delivered_fraction
    chosen["cluster"] = args.cluster
    if args.consumer:  # otherwise the settings name it <host>-<pid>
        chosen["consumer"] = args.consumer
    return WorkerSettings(url=redis_url(args.url), **chosen)


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
    return verb_main("tokcap worker", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
