"""A worker's side of the job queue, on every shard: read, claim, ack, dead-letter.

A queue of S shards is S streams, each on the master of its own hash tag
(``transports.redis.keys.shard_streams``); one XREADGROUP cannot span them on a cluster
(its keys would cross slots), so a worker reads them in turn. A read first looks at each
shard without waiting, starting one further each time so none is always last; only when
all were empty does it wait, on one shard, for ``block_ms / S``: a job on another shard
then waits at most that long, and a worker that is busy never waits at all. With one
shard this is the one blocking read it always was.

Stale jobs are claimed from every shard, each with its own XAUTOCLAIM cursor, and the
heartbeat touches each job on its own shard. A job ends on its own shard too: acked and
deleted, or moved to the shard's dead-letter stream, in one transaction with forgetting
the errors its failed attempts noted (``transports.redis.keys.job_errors_key``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from transports.rebuild.results import ensure_group
from transports.redis.keys import Streams, as_text, job_errors_key


class Job(NamedTuple):
    """One job as a worker received it: its shard's streams, id, fields, delivery count."""

    streams: Streams
    job_id: str
    fields: Any
    deliveries: int


class JobShards:
    """One worker's view of the jobs streams of every shard in its consumer group."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        shards: list[Streams],
        group: str,
        consumer: str,
    ) -> None:
        self.client = client
        self.shards = shards
        self.group = group
        self.consumer = consumer
        self._turn = 0  # which shard a read starts with
        self._claim_cursors = {streams.jobs: "0-0" for streams in shards}

    async def ensure_groups(self) -> None:
        """Create each shard's group (and stream) unless it exists; join it as a consumer."""
        for streams in self.shards:
            await ensure_group(self.client, streams.jobs, self.group)
            # Visible in XINFO CONSUMERS from the start, not only after its first job.
            await self.client.xgroup_createconsumer(streams.jobs, self.group, self.consumer)

    def _in_turn(self) -> list[Streams]:
        start = self._turn % len(self.shards)
        self._turn += 1
        return self.shards[start:] + self.shards[:start]

    async def read_new(self, count: int, block_ms: int) -> list[Job]:
        """Up to ``count`` new jobs from the shards, waiting only when all are empty."""
        order = self._in_turn()
        jobs: list[Job] = []
        for streams in order[:-1]:
            jobs += await self._read(streams, count - len(jobs), None)
            if len(jobs) >= count:
                return jobs
        if jobs:
            return jobs + await self._read(order[-1], count - len(jobs), None)
        return await self._read(order[-1], count, max(1, block_ms // len(self.shards)))

    async def _read(self, streams: Streams, count: int, block_ms: int | None) -> list[Job]:
        reply = await self.client.xreadgroup(
            self.group, self.consumer, {streams.jobs: ">"}, count=count, block=block_ms
        )
        entries = reply[0][1] if reply else []
        return [Job(streams, as_text(job_id), fields, 1) for job_id, fields in entries]

    async def claim_stale(self, count: int, idle_ms: int, running: set[str]) -> list[Job]:
        """Take over jobs another consumer left pending for ``idle_ms``, from every shard.

        ``running`` holds the jobs this worker runs now (``stream/job id``): a job of its
        own that only looked idle because a long build held the event loop is left alone.
        """
        jobs: list[Job] = []
        for streams in self._in_turn():
            if len(jobs) >= count:
                break
            jobs += await self._claim(streams, count - len(jobs), idle_ms, running)
        return jobs

    async def _claim(
        self, streams: Streams, count: int, idle_ms: int, running: set[str]
    ) -> list[Job]:
        reply = await self.client.xautoclaim(
            streams.jobs,
            self.group,
            self.consumer,
            idle_ms,
            start_id=self._claim_cursors[streams.jobs],
            count=count,
        )
        # The next round goes on where this one ended.
        self._claim_cursors[streams.jobs] = as_text(reply[0])
        claimed = [
            (as_text(job_id), fields)
            for job_id, fields in reply[1]
            if job_key(streams, as_text(job_id)) not in running
        ]
        if not claimed:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for job_id, _ in claimed:
                pipe.xpending_range(streams.jobs, self.group, min=job_id, max=job_id, count=1)
            pending = await pipe.execute()
        jobs = []
        for (job_id, fields), info in zip(claimed, pending, strict=True):
            if not info:
                continue  # acked meanwhile by the worker it was taken from: it finished after all
            jobs.append(Job(streams, job_id, fields, int(info[0]["times_delivered"])))
        return jobs

    async def touch(self, jobs: Iterable[Job]) -> None:
        """Reset the idle time of ``jobs`` (the heartbeat), on each one's own shard."""
        by_stream: dict[str, list[str]] = {}
        for job in jobs:
            by_stream.setdefault(job.streams.jobs, []).append(job.job_id)
        for stream, ids in by_stream.items():
            await self.client.xclaim(stream, self.group, self.consumer, 0, ids, justid=True)

    async def last_error(self, streams: Streams, job_id: str) -> str | None:
        """The error the latest failed attempt at the job noted, if any."""
        last = await self.client.hget(job_errors_key(streams.jobs), job_id)
        return as_text(last) if last else None

    async def note_error(self, streams: Streams, job_id: str, error: str) -> None:
        """Note why an attempt failed: the attempt that gives up on the job says it."""
        await self.client.hset(job_errors_key(streams.jobs), job_id, error)

    async def ack(self, streams: Streams, job_id: str) -> None:
        """Ack and delete a finished job, and forget its errors, in one transaction."""
        async with self.client.pipeline(transaction=True) as pipe:
            self._remove(pipe, streams, job_id)
            await pipe.execute()

    async def dead_letter(
        self, streams: Streams, job_id: str, fields: Any, error: str, deliveries: int
    ) -> None:
        """Move a job to its shard's dead-letter stream, with its error and how many times
        it was delivered, in the transaction that acks it."""
        dead = {as_text(key): value for key, value in (fields or {}).items()}
        dead.update(
            job_id=job_id,
            error=error,
            attempts=str(deliveries),
            consumer=self.consumer,
            failed_at=str(time.time()),
        )
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(streams.dead, dead)
            self._remove(pipe, streams, job_id)
            await pipe.execute()

    def _remove(self, pipe: Any, streams: Streams, job_id: str) -> None:
        """Queue the ack, the delete and the forgetting of a job's errors (one slot)."""
        pipe.xack(streams.jobs, self.group, job_id)
        pipe.xdel(streams.jobs, job_id)
        pipe.hdel(job_errors_key(streams.jobs), job_id)


def job_key(streams: Streams, job_id: str) -> str:
    """A job's name across shards: stream ids are only unique within one stream."""
    return f"{streams.jobs}/{job_id}"
