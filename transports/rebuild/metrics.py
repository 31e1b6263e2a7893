"""Prometheus metrics of one rebuild worker process, served on an opt-in port.

The worker counts what its jobs became (rebuilt by result, dead-lettered by reason, retried),
how long a rebuild took and why results were masked (``capture.mask_reasons`` slugs, a
bounded set), and samples the queue it reads every ``interval_s``: the jobs no worker has
taken yet, the jobs taken but not finished, and the age of the oldest job not finished.

A finished job is acked and deleted from its stream in one transaction (dead letters too),
so a jobs stream holds exactly the jobs not finished: its length less the group's pending
count is what waits. The age is read from the oldest entry's id, a Redis timestamp, against
the server's own clock (``TIME``). Every worker reads every shard, so every worker reports
the whole queue: a dashboard takes the ``max`` of those gauges over workers, never the sum.

Each process has its own registry and serves it with ``prometheus_client``'s HTTP server
(``MetricsServer``): several worker processes on one host each take their own port. No label
holds a URL, a host name or any other value a credential could hide in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from capture.delivery import RolloutBuild
from capture.mask_reasons import UNSTATED, reason_slug
from transports.redis.keys import as_text

if TYPE_CHECKING:
    from transports.rebuild.publish import Published
    from transports.rebuild.shards import JobShards

log = logging.getLogger("tokcap.worker")

# A rebuild reads a snapshot, merges its calls and publishes: milliseconds for a short
# rollout, seconds for a long one on a busy Redis.
REBUILD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# What a finished job's result was: unmasked (its snapshot retired), masked, or skipped (the
# record already carried token ids). And why a job went to the dead-letter stream.
RESULTS = ("delivered", "masked", "skipped")
DEAD_REASONS = ("malformed", "attempts")
QUEUE_STATES = ("waiting", "pending")


@dataclass(frozen=True)
class QueueDepth:
    """The queue as one sample saw it, summed over its shards."""

    waiting: int  # in a stream, not yet delivered to any worker of the group
    pending: int  # delivered, neither acked nor dead-lettered yet
    oldest_age_s: float  # of the oldest job not finished; 0 when there is none


@dataclass
class WorkerMetrics:
    """One worker process's counters and gauges, in a registry of its own."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self._count_jobs()
        self._time_jobs()
        self._watch_queue()

    def _count_jobs(self) -> None:
        """What became of each job this process ran, and why results were masked."""
        self.rebuilt = Counter(
            "tokcap_rebuilt_jobs",
            "Jobs rebuilt, published and acked, by result (delivered, masked, skipped)",
            ["result"],
            registry=self.registry,
        )
        self.dead = Counter(
            "tokcap_dead_jobs",
            "Jobs moved to the dead-letter stream, by reason (malformed record, or attempts "
            "used up)",
            ["reason"],
            registry=self.registry,
        )
        self.retried = Counter(
            "tokcap_retried_jobs",
            "Failed attempts at a job that left it pending, to be claimed and tried again",
            registry=self.registry,
        )
        self.superseded = Counter(
            "tokcap_superseded_results",
            "Results published that supersede an earlier result of their rollout",
            registry=self.registry,
        )
        self.mask_reasons = Counter(
            "tokcap_mask_reasons",
            "Reasons of the masked results published, by slug (a result masked for two "
            "reasons counts under both)",
            ["reason"],
            registry=self.registry,
        )
        for result in RESULTS:  # every series exists from the start, at zero
            self.rebuilt.labels(result=result)
        for reason in DEAD_REASONS:
            self.dead.labels(reason=reason)

    def _time_jobs(self) -> None:
        """How long rebuilds take, and how many run now (the worker reads its own count)."""
        self.rebuild_seconds = Histogram(
            "tokcap_rebuild_seconds",
            "Time from taking a job to acking it, for jobs rebuilt",
            buckets=REBUILD_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tokcap_rebuild_jobs_in_flight",
            "Jobs this worker process is running now",
            registry=self.registry,
        )

    def _watch_queue(self) -> None:
        """The queue this worker reads, as the latest sample saw it (the same for every
        worker of the group)."""
        self.queue_jobs = Gauge(
            "tokcap_rebuild_queue_jobs",
            "Jobs in the queue not finished: waiting for a worker, or pending (taken, not "
            "finished), summed over shards",
            ["state"],
            registry=self.registry,
        )
        self.oldest_age = Gauge(
            "tokcap_rebuild_oldest_job_age_seconds",
            "Age of the oldest job in the queue not finished (0: none)",
            registry=self.registry,
        )
        for state in QUEUE_STATES:
            self.queue_jobs.labels(state=state)

    def record_rebuilt(self, built: RolloutBuild, published: Published, seconds: float) -> None:
        """Count a job acked with its result; a masked one also counts each mask reason."""
        result = result_of(built, published)
        self.rebuilt.labels(result=result).inc()
        self.rebuild_seconds.observe(seconds)
        if result == "masked":
            for slug in mask_slugs(built.summary.mask_reasons):
                self.mask_reasons.labels(reason=slug).inc()

    def record_queue(self, depth: QueueDepth) -> None:
        self.queue_jobs.labels(state="waiting").set(depth.waiting)
        self.queue_jobs.labels(state="pending").set(depth.pending)
        self.oldest_age.set(depth.oldest_age_s)


def result_of(built: RolloutBuild, published: Published) -> str:
    """The job's result as the trainer receives it: as the worker's settle step decides.

    Delivered only when this unmasked build is what was published; a masked result
    published first under the same guard leaves the trainer a masked one.
    """
    if built.ok and published.ok:
        return "delivered"
    return "skipped" if built.skipped else "masked"


def mask_slugs(reasons: Iterable[str]) -> set[str]:
    """Each reason's slug once; a masked result that names no reason is ``unstated``."""
    return {reason_slug(reason) for reason in reasons} or {UNSTATED}


async def read_depth(jobs: JobShards) -> QueueDepth:
    """Sample every shard of the queue: XLEN, the group's XPENDING summary, the oldest id."""
    waiting = pending = 0
    oldest_ms: int | None = None
    for streams in jobs.shards:
        length = int(await jobs.client.xlen(streams.jobs))
        taken = int((await jobs.client.xpending(streams.jobs, jobs.group))["pending"])
        waiting += max(length - taken, 0)
        pending += taken
        first = await jobs.client.xrange(streams.jobs, count=1)
        if first:
            stamp = int(as_text(first[0][0]).partition("-")[0])
            oldest_ms = stamp if oldest_ms is None else min(oldest_ms, stamp)
    age_s = 0.0
    if oldest_ms is not None:
        seconds, micros = await jobs.client.time()
        age_s = max(seconds + micros / 1e6 - oldest_ms / 1000, 0.0)
    return QueueDepth(waiting, pending, age_s)


async def watch_queue(
    jobs: JobShards, metrics: WorkerMetrics, interval_s: float, done: asyncio.Event
) -> None:
    """Sample the queue every ``interval_s`` until ``done`` is set.

    A failed sample leaves the gauges at the last one: the queue's depth is not worth a
    worker, and the job reads already report a Redis that does not answer. The loop ends on
    ``done``, not on cancellation alone: a cancel that lands inside a redis-py command can
    be lost there (seen with redis-py 8.2 on Python 3.11), and the task would sample on.
    """
    while not done.is_set():
        try:
            metrics.record_queue(await read_depth(jobs))
        except Exception as exc:
            log.debug("could not sample the queue: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), interval_s)


class MetricsServer:
    """The HTTP server of one process's metrics (``GET /metrics``), in a daemon thread."""

    def __init__(self, metrics: WorkerMetrics, host: str, port: int) -> None:
        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.host = host
        self.port = int(self._server.server_address[1])  # the one bound, when port was 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def close(self) -> None:
        """Stop serving; ``shutdown`` waits for the server's poll loop, off the event loop."""
        await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()
        self._thread.join(timeout=5)
