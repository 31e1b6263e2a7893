"""The rebuild worker: jobs in, rebuilt records out, snapshots retired only after that.

Per job: ``finalize_rollout_token_capture`` through the Redis source → publish the rebuilt
record to the results stream, at most once per (rollout, snapshot id, version) → wait until
that write is durable → retire the snapshot (only for a good build whose published result is
that good build; masked or failed builds keep their evidence) → ``XACK``. Every step can be
repeated after a crash: freeze is idempotent, the publish guard answers with the first result
id and whether it was unmasked, and drop of an already dropped snapshot is True. So a job of a
killed worker is simply run again by whoever claims it (``XAUTOCLAIM`` after ``claim_idle_ms``).

The worker never destroys evidence. A record that cannot be rebuilt goes to the dead-letter
stream before anything is frozen or published, so a later valid job of the same rollout still
gets the real result. A build that could not reach the store is retried, never published. When
a late loss mark changes the snapshot between publish and retire, the rollout is rebuilt from
the job's record again and the new result names the one it supersedes (``supersedes`` on the
stream, ``_ng_supersedes`` on the decoded record); the publish script sets that link itself
from the rollout's latest result, so a re-run after a crash links it too.

A job that fails ``max_attempts`` times, or that can never succeed (a malformed record),
goes to the dead-letter stream with its error and is acked. One process runs
``concurrency`` jobs at once as asyncio tasks; start more processes to scale.

The queue itself (read, claim, heartbeat, ack, dead letter) is ``transports.rebuild.shards``:
with ``shards`` > 1, or on a Redis Cluster (``cluster``), every worker reads every shard of
the queue in its group; a job's dead letter, its errors and its result stay on its shard,
the one of its rollout id. Reading jobs and joining the groups ride out a lost connection, or
a cluster master that cannot prove the durability yet (``RebuildWorker.is_outage``), in
``capture.outage``'s loop, pausing ``READ_RETRY_PAUSE_S`` between tries, until ``stop``.

Every worker counts its jobs in Prometheus metrics (``transports.rebuild.metrics``); with
``metrics_port`` set it serves them and samples the queue's depth while it runs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from redis.exceptions import ResponseError

from capture.delivery import (
    RolloutBuild,
    finalize_rollout_token_capture,
    retire_rollout_token_capture,
)
from capture.outage import retry_through_outage
from transports.rebuild.jobs import MalformedJobError, decode_job
from transports.rebuild.layout import agree_on_layout
from transports.rebuild.metrics import MetricsServer, WorkerMetrics, watch_queue
from transports.rebuild.publish import Published, ResultToPublish, publish_durably
from transports.rebuild.results import encode_result
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.shards import Job, JobShards, job_key
from transports.redis import RedisTokenStore
from transports.redis import keys as k
from transports.redis.clients import TRANSIENT_ERRORS
from transports.redis.keys import Streams

log = logging.getLogger("tokcap.worker")

# A late loss mark can change a snapshot between publish and retire; each round rebuilds it
# and supersedes the published result. Redis marks only ever mask, so two rounds settle it.
REBUILD_ROUNDS = 3

# When reading jobs fails on the connection, wait this long before trying again.
READ_RETRY_PAUSE_S = 1.0
# Stale jobs are looked for twice per claim_idle_ms (within these bounds), and the jobs in
# flight are touched three times per claim_idle_ms, so a live job never looks idle that long.
CLAIMS_PER_IDLE, MIN_CLAIM_PAUSE_S, MAX_CLAIM_PAUSE_S = 2, 0.05, 5.0
HEARTBEATS_PER_IDLE, MIN_HEARTBEAT_PAUSE_S = 3, 0.02


class TransientJobError(Exception):
    """A step failed in a way a later attempt may not; the job stays pending."""


class RebuildWorker:
    """One process's pool of rebuild tasks on the jobs stream."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        # One client for everything: the store's, whose connections prove durability as
        # they open; the job reads, acks and error notes go through it once ``start`` has
        # proven the server.
        self.source = RedisTokenStore.from_options(settings.redis, key_prefix=settings.key_prefix)
        self.client: Any = None
        self.jobs: JobShards | None = None
        self.counts = dict.fromkeys(
            (
                "done",
                "published",
                "retired",
                "retire_refused",
                "superseded",
                "masked",
                "skipped",
                "dead",
                "failed",
            ),
            0,
        )
        self._stop = asyncio.Event()
        self._in_flight: dict[asyncio.Task[None], Job] = {}
        self.metrics = WorkerMetrics()
        self.metrics.in_flight.set_function(lambda: len(self._in_flight))
        self.metrics_server: MetricsServer | None = None  # while ``run`` serves them
        self._next_claim = 0.0  # when to look for stale jobs next (monotonic)

    def stop(self) -> None:
        """Take no new jobs; ``run`` returns once the jobs in flight are finished."""
        if not self._stop.is_set():
            log.info("stopping: finishing %d job(s) in flight", len(self._in_flight))
        self._stop.set()

    async def start(self) -> None:
        """Check the server's durability and create the consumer groups (idempotent).

        A cluster replacing a master fails the group step for a while: it is tried again
        until the worker stops (a store that cannot be reached at all has raised already).
        """
        await self.source.check()
        settings = self.settings
        if self.jobs is None:
            self.client = self.source.client
            self.jobs = JobShards(
                self.client, settings.shard_streams, settings.group, settings.consumer
            )
        await retry_through_outage(
            self._join_groups,
            is_outage=lambda exc: self.is_outage(exc) and not self._stop.is_set(),
            pause_after=lambda failures: READ_RETRY_PAUSE_S,
            on_outage=lambda exc, pause_s: log.warning(
                "cannot create the consumer groups (%s); retrying", exc
            ),
            between=self.source.refresh,
        )

    def is_outage(self, exc: Exception) -> bool:
        """Whether a failed job read, group join or heartbeat is tried again: a transient
        error, or one the store waits out in its own operations (``RedisTokenStore.is_outage``).

        The queue goes through the store's client, whose every new connection proves the
        durability: on a cluster with ``replicas:N`` a master that has just been promoted
        (its lost peer not yet back as its replica), or one that lost its replica, refuses
        that proof with a ConfigError. The store waits that out; judged by its type alone it
        ended the worker's task, silently, and every job queued after a failover stayed
        unread (a CI run of the killed-master test saw it). Between tries the slot map is
        read again (``RedisTokenStore.refresh``): a refusal by a replica that a stale map
        names as the master would otherwise repeat for ever.
        """
        return isinstance(exc, TRANSIENT_ERRORS) or self.source.is_outage(exc)

    async def _join_groups(self) -> None:
        """Agree on the streams' layout with every other user, then join the job groups."""
        settings = self.settings
        for stream in (settings.jobs_stream, settings.results_stream):
            await agree_on_layout(self.client, stream, settings.shards, settings.cluster, "worker")
        await self.jobs.ensure_groups()

    async def run(self) -> None:
        """Process jobs until ``stop``; in-flight jobs always finish, even on an error.

        The metrics are served from the start, so a worker still waiting for its Redis is
        scraped too; the queue is sampled once the groups exist.
        """
        helpers: list[asyncio.Task[None]] = []
        done = asyncio.Event()  # ends the queue's sampler, whether or not a cancel reaches it
        self._serve_metrics()
        try:
            await self.start()
            helpers.append(asyncio.create_task(self._heartbeat()))
            if self.metrics_server is not None:
                interval_s = self.settings.metrics_interval_s
                sampler = watch_queue(self.jobs, self.metrics, interval_s, done)
                helpers.append(asyncio.create_task(sampler))
            await self._dispatch()
        finally:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
            done.set()
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await self.close()

    def _serve_metrics(self) -> None:
        """Serve the metrics on ``metrics_port`` (when set); a port taken ends the worker."""
        s = self.settings
        if s.metrics_port is None or self.metrics_server is not None:
            return
        self.metrics_server = MetricsServer(self.metrics, s.metrics_host, s.metrics_port)
        log.info("metrics at %s", self.metrics_server.url)

    async def _dispatch(self) -> None:
        """Keep up to ``concurrency`` jobs in flight: stale ones first, then new ones."""
        self._next_claim = 0.0  # stale jobs are looked for first
        while not self._stop.is_set():
            if len(self._in_flight) >= self.settings.concurrency:
                await asyncio.wait(list(self._in_flight), return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                jobs = await retry_through_outage(
                    self._take_jobs,
                    is_outage=self.is_outage,
                    pause_after=lambda failures: READ_RETRY_PAUSE_S,
                    on_outage=lambda exc, pause_s: log.warning(
                        "cannot read jobs (%s); retrying in %g s", exc, pause_s
                    ),
                    between=self.source.refresh,
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("the jobs stream or group was deleted; creating it again")
                await self.start()
                continue
            for job in jobs:
                task = asyncio.create_task(
                    self._run_job(job.job_id, job.fields, job.deliveries, job.streams)
                )
                self._in_flight[task] = job
                task.add_done_callback(self._in_flight.pop)

    async def _take_jobs(self) -> list[Job]:
        """As many jobs as there is room for: stale ones when it is time to look for them,
        else new ones; none once the worker stops (a read that failed is not tried again)."""
        if self._stop.is_set():
            return []
        free = self.settings.concurrency - len(self._in_flight)
        jobs: list[Job] = []
        if time.monotonic() >= self._next_claim:
            jobs = await self._claim_stale(free)
            self._next_claim = time.monotonic() + self._claim_pause_s()
        if not jobs:
            jobs = await self.jobs.read_new(free, self.settings.block_ms)
        return jobs

    def _claim_pause_s(self) -> float:
        """How long between looks for stale jobs: ``CLAIMS_PER_IDLE`` per claim_idle_ms."""
        idle_s = self.settings.claim_idle_ms / 1000
        return min(max(idle_s / CLAIMS_PER_IDLE, MIN_CLAIM_PAUSE_S), MAX_CLAIM_PAUSE_S)

    async def close(self) -> None:
        await self.source.close()  # its client is the worker's too
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None

    async def _claim_stale(self, count: int) -> list[Job]:
        """Take over jobs another consumer left pending for ``claim_idle_ms``."""
        running = {job_key(job.streams, job.job_id) for job in self._in_flight.values()}
        jobs = await self.jobs.claim_stale(count, self.settings.claim_idle_ms, running)
        for job in jobs:
            log.info("claimed stale job %s (delivery %d)", job.job_id, job.deliveries)
        return jobs

    async def _heartbeat(self) -> None:
        """Reset the idle time of jobs in flight so a slow job is not taken over while alive."""
        s = self.settings
        pause_s = max(s.claim_idle_ms / 1000 / HEARTBEATS_PER_IDLE, MIN_HEARTBEAT_PAUSE_S)
        while True:
            await asyncio.sleep(pause_s)
            jobs = list(self._in_flight.values())
            if not jobs:
                continue
            try:
                await self.jobs.touch(jobs)
            except Exception as exc:
                if not self.is_outage(exc):
                    raise
                log.warning("heartbeat failed: %s", exc)

    def streams_of(self, rollout_id: str) -> Streams:
        """The shard of a rollout: where its job was queued and its result is published."""
        shards = self.settings.shard_streams
        return shards[k.shard_of(rollout_id, len(shards))]

    async def _run_job(
        self, job_id: str, fields: Any, deliveries: int, streams: Streams | None = None
    ) -> None:
        s = self.settings
        streams = streams or s.shard_streams[0]
        try:
            if fields is None:
                return  # deleted from the stream while pending; XAUTOCLAIM already dropped it
            if deliveries > s.max_attempts:
                error = (
                    await self.jobs.last_error(streams, job_id)
                    or "no error recorded: the worker holding it stopped"
                )
                await self._dead_letter(
                    job_id,
                    fields,
                    f"gave up after {deliveries - 1} attempts; last error: {error}",
                    deliveries,
                    streams,
                )
                return
            await self.process(job_id, fields, streams)
        except MalformedJobError as exc:
            await self._dead_letter(
                job_id, fields, str(exc), deliveries, streams, reason="malformed"
            )
        except Exception as exc:  # any other failure: keep the job pending, or give up
            self.counts["failed"] += 1
            error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "job %s failed (attempt %d of %d): %s", job_id, deliveries, s.max_attempts, error
            )
            try:
                if deliveries >= s.max_attempts:
                    await self._dead_letter(job_id, fields, error, deliveries, streams)
                else:
                    self.metrics.retried.inc()
                    await self.jobs.note_error(streams, job_id, error)
            except Exception as inner:
                log.error("could not record the failure of job %s: %s", job_id, inner)

    async def process(
        self, job_id: str, fields: Mapping[Any, Any], streams: Streams | None = None
    ) -> None:
        """Rebuild one job's rollout, publish it once, retire it, ack the job.

        When the snapshot changed after its result was published (retire refused), the
        rollout is rebuilt and the new result supersedes the published one, a few rounds at
        most; a rollout still changing after that is retried as a failed job. ``streams``
        is the shard the job was read from (by default, its rollout's).
        """
        began = time.monotonic()
        for _ in range(REBUILD_ROUNDS):
            rollout_id, record = decode_job(fields)  # finalize mutates it: a fresh copy each round
            built = await self._build(rollout_id, record)
            published = await self._publish(job_id, rollout_id, record, built)
            if await self._settle(job_id, rollout_id, built, published):
                break
        else:
            raise TransientJobError(
                f"rollout {rollout_id} changed after each of {REBUILD_ROUNDS} rebuilds"
            )
        await self.jobs.ack(streams or self.streams_of(rollout_id), job_id)
        self.counts["done"] += 1
        self.metrics.record_rebuilt(built, published, time.monotonic() - began)

    async def _build(self, rollout_id: str, record: dict[str, Any]) -> RolloutBuild:
        """Finalize the record; a record or source error raises instead of being published.

        A record error froze nothing, so dead-lettering it leaves the rollout to a later
        valid job; a source error says nothing about the capture, so it is retried.
        """
        built = await finalize_rollout_token_capture(
            record,
            self.source,
            rollout_id=rollout_id,
            delivery=self.settings.delivery,
            min_delivered_fraction=self.settings.min_delivered_fraction,
        )
        if built.error_kind == "record":
            raise MalformedJobError(f"job record cannot be rebuilt: {built.error}")
        if built.error_kind == "source":
            raise TransientJobError(f"the store was unreachable during the build: {built.error}")
        return built

    async def _settle(
        self, job_id: str, rollout_id: str, built: RolloutBuild, published: Published
    ) -> bool:
        """Retire what may be retired; False when the rollout must be rebuilt again."""
        self.counts["published"] += int(published.fresh)
        if published.fresh and published.supersedes:
            self.counts["superseded"] += 1
            self.metrics.superseded.inc()
        if published.stale:
            log.warning(
                "rollout %s: a newer version than v%s was already published (%s); rebuilding",
                rollout_id,
                built.version,
                published.result_id,
            )
            return False
        # Retire only when what the trainer receives is this unmasked build of this snapshot:
        # a masked result published first under the same guard still needs the evidence.
        retired = False
        if built.ok and published.ok:
            retired = await retire_rollout_token_capture(rollout_id, self.source, built)
            if not retired:
                self.counts["retire_refused"] += 1
                log.warning(
                    "rollout %s changed after snapshot %s v%s was published as %s; rebuilding",
                    rollout_id,
                    built.snapshot_id,
                    built.version,
                    published.result_id,
                )
                return False
            self.counts["retired"] += 1
        elif built.skipped:
            self.counts["skipped"] += 1  # the record already carried token ids
        else:
            self.counts["masked"] += 1
        self._log_job(job_id, rollout_id, built, published, retired)
        return True

    def _log_job(
        self,
        job_id: str,
        rollout_id: str,
        built: RolloutBuild,
        published: Published,
        retired: bool,
    ) -> None:
        log.info(
            "job %s: rollout %s snapshot %s v%s %s, result %s%s%s, %s",
            job_id,
            rollout_id,
            built.snapshot_id or "-",
            built.version,
            "skipped" if built.skipped else "masked" if built.masked or not built.ok else "ok",
            published.result_id,
            "" if published.fresh else " (already published)",
            f" superseding {published.supersedes}" if published.supersedes else "",
            "retired" if retired else "kept",
        )

    async def _publish(
        self, job_id: str, rollout_id: str, record: dict[str, Any], built: RolloutBuild
    ) -> Published:
        """XADD the result unless this snapshot version was published before."""
        s = self.settings
        fields = encode_result(
            record,
            rollout_id=rollout_id,
            snapshot_id=built.snapshot_id or "",
            version=built.version,
            ok=bool(built.ok),
            masked=bool(built.masked),
            job_id=job_id,
            worker=s.consumer,
        )
        results = self.streams_of(rollout_id).results
        return await publish_durably(
            self.source,
            ResultToPublish(results, rollout_id, job_id, built, fields),
            guard_ttl_s=s.guard_ttl_s,
        )

    async def _dead_letter(
        self,
        job_id: str,
        fields: Any,
        error: str,
        deliveries: int,
        streams: Streams,
        reason: str = "attempts",
    ) -> None:
        """Move the job to its shard's dead letters; ``reason`` is the metric's label:
        ``malformed`` (it can never be rebuilt) or ``attempts`` (it used them all up)."""
        self.counts["dead"] += 1
        self.metrics.dead.labels(reason=reason).inc()
        log.error("job %s goes to %s: %s", job_id, streams.dead, error)
        await self.jobs.dead_letter(streams, job_id, fields, error, deliveries)


async def run_worker(
    settings: WorkerSettings,
    worker_type: Callable[[WorkerSettings], RebuildWorker] = RebuildWorker,
) -> dict[str, int]:
    """Run one worker until SIGTERM or SIGINT; returns its counters.

    ``worker_type`` builds the worker; tests pass a subclass that widens a window.
    """
    worker = worker_type(settings)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.stop)
    try:
        await worker.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    return worker.counts
