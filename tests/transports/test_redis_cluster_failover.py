"""A master killed (SIGKILL) under load: its replica takes over, nothing acknowledged is lost.

A cluster of the test's own, durability ``replicas:1``: every acknowledged put waited for
the slot's replica (``WAIT 1`` on the master's connection), so the replica that replaces
the master holds it. Writers and a rebuild worker run throughout; the killed node comes back
and rejoins as the new master's replica (until then, writes to its slots cannot prove
``replicas:1`` and are retried, never acknowledged). Afterwards every acknowledged entry is
in the store with its exact ids, writers went on acknowledging puts to the lost master's
slots, and every submitted job was rebuilt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from capture.errors import TokenCaptureError
from capture.records import TokenEntry
from tests.support.fixtures_stores import make_token_entry
from tests.support.rebuild import assert_rebuilt, finished_record, rollout_entries
from tokcap_devtools.redis_cluster import LocalCluster
from transports.rebuild.jobs import RebuildQueue
from transports.rebuild.reader import ResultsReader
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker
from transports.redis import RedisTokenStore
from transports.redis import keys as k

pytestmark = pytest.mark.timeout(240)

PREFIX, WRITERS, SHARDS, TURNS = "fo", 12, 3, 2
FAILURES = (TokenCaptureError, redis.RedisError, redis.exceptions.RedisClusterException, OSError)


async def eventually(what: str, holds: Callable[[], Awaitable[bool]], limit_s: float) -> None:
    """Poll until ``holds()``; past ``limit_s`` the test fails saying what never happened."""
    deadline = time.monotonic() + limit_s
    while not await holds():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {limit_s} s")
        await asyncio.sleep(0.1)


def master_port_of(cluster: LocalCluster, key: str) -> int:
    """The port of the master serving ``key`` now, as a surviving master tells it."""
    slot = key_slot(key.encode())
    for node in cluster.masters():
        try:
            with redis.Redis(port=node.port, socket_timeout=2) as client:
                ranges = client.execute_command("CLUSTER SLOTS")
        except redis.RedisError:
            continue
        for first, last, master, *_ in ranges:
            if first <= slot <= last:
                return int(master[1])
    raise AssertionError("no master of the cluster answers")


class Writers:
    """``WRITERS`` rollouts, each putting its next call as soon as the last one returned."""

    def __init__(self, store: RedisTokenStore) -> None:
        self.store = store
        self.acknowledged: dict[str, list[TokenEntry]] = {f"w{n}": [] for n in range(WRITERS)}
        self.failed = 0
        self.stop = asyncio.Event()

    async def run(self, rollout_id: str) -> None:
        number = 0
        while not self.stop.is_set():
            entry = make_token_entry(rollout_id, f"c{number:05d}")
            number += 1
            try:
                await self.store.put(entry)
            except FAILURES:
                self.failed += 1  # not acknowledged: it may or may not be stored
                await asyncio.sleep(0.05)
                continue
            self.acknowledged[rollout_id].append(entry)

    def each_has(self, count: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return all(len(entries) >= count for entries in self.acknowledged.values())

        return check


async def submit_all(queue: RebuildQueue, rollout_ids: list[str]) -> None:
    """Submit each job, retrying while the cluster is replacing a master."""
    for rollout_id in rollout_ids:
        while True:
            try:
                await queue.submit(finished_record(rollout_id))
                break
            except FAILURES:
                await asyncio.sleep(0.2)


async def read_all(reader: ResultsReader, count: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    while len(records) < count:
        try:
            batch = await reader.read()
        except FAILURES:
            await asyncio.sleep(0.2)
            continue
        for record in batch:
            assert_rebuilt(record, TURNS)
            records.append(record)
            while True:
                try:
                    await reader.ack(record)
                    break
                except FAILURES:
                    await asyncio.sleep(0.2)
    return records


async def test_a_killed_master_loses_no_acknowledged_put_and_everyone_reconnects(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory()
    url = cluster.url
    options: dict[str, Any] = dict(key_prefix=PREFIX, durability="replicas:1")
    store = RedisTokenStore(url=url, cluster=True, failover_timeout_s=20, **options)
    jobs = [f"job-{n:02d}" for n in range(30)]
    for rollout_id in jobs:  # the rollouts the worker rebuilds, written before the kill
        for entry in rollout_entries(rollout_id, TURNS):
            await store.put(entry)
    worker = RebuildWorker(
        WorkerSettings(
            url=url,
            cluster=True,
            shards=SHARDS,
            block_ms=100,
            claim_idle_ms=1500,  # jobs that failed during the failover come back soon
            max_attempts=100,
            **options,
        )
    )
    worker_task = asyncio.create_task(worker.run())
    writers = Writers(store)
    writing = [asyncio.create_task(writers.run(rollout_id)) for rollout_id in writers.acknowledged]
    queue = RebuildQueue(url=url, stream=k.stream_names(PREFIX).jobs, shards=SHARDS, cluster=True)
    reader = ResultsReader(
        url=url, stream=k.stream_names(PREFIX).results, shards=SHARDS, cluster=True, block_ms=100
    )
    reading = asyncio.create_task(read_all(reader, len(jobs)))
    try:
        await submit_all(queue, jobs[:10])
        await eventually("5 puts per writer", writers.each_has(5), 60)

        async def rebuilding() -> bool:
            assert not worker_task.done(), worker_task
            return worker.counts["done"] >= 3

        await eventually("the worker's first jobs", rebuilding, 60)
        victim_key = k.rollout_key(PREFIX, "w0")
        victim = next(n for n in cluster.nodes if n.port == master_port_of(cluster, victim_key))
        before = {w: len(entries) for w, entries in writers.acknowledged.items()}
        victim.kill9()

        async def replaced() -> bool:
            return await asyncio.to_thread(master_port_of, cluster, victim_key) != victim.port

        await eventually("the failover to the replica", replaced, 60)
        await submit_all(queue, jobs[10:20])
        # It rejoins as the new master's replica.
        await asyncio.to_thread(cluster.start_node, victim)
        await asyncio.to_thread(cluster.wait_healthy, 60)
        masters = await asyncio.to_thread(cluster.masters)
        assert victim.port not in {node.port for node in masters}  # back as a replica
        await submit_all(queue, jobs[20:])
        # Writers go on by themselves: every rollout, the lost master's included, gets more.
        await eventually("5 more puts per writer", writers.each_has(max(before.values()) + 5), 60)
        writers.stop.set()
        records = await asyncio.wait_for(reading, 120)
        assert not worker_task.done(), worker_task
    finally:
        writers.stop.set()
        await asyncio.gather(*writing, return_exceptions=True)
        worker.stop()
        await asyncio.gather(worker_task, return_exceptions=True)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await reader.close()
        await queue.close()
    assert sorted(r["_ng_rollout_id"] for r in records) == jobs
    for rollout_id, acknowledged in writers.acknowledged.items():
        stored = {entry.model_call_id: entry for entry in await store.peek(rollout_id)}
        lost = [e.model_call_id for e in acknowledged if e.model_call_id not in stored]
        assert lost == [], f"{rollout_id}: acknowledged and lost: {lost}"
        for entry in acknowledged:
            held = stored[entry.model_call_id]
            assert held.prompt_token_ids == entry.prompt_token_ids
            assert held.generation_token_ids == entry.generation_token_ids
            assert held.generation_log_probs == entry.generation_log_probs
    await store.close()
