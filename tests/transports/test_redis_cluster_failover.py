"""A master killed (SIGKILL) under load: its replica takes over, nothing acknowledged is lost.

A cluster of the test's own, durability ``replicas:1``: every acknowledged put waited for
the slot's replica (``WAIT 1`` on the master's connection), so the replica that replaces
the master holds it. Writers and a rebuild worker run throughout; the killed node comes back
and rejoins as the new master's replica (until then, writes to its slots cannot prove
``replicas:1`` and are retried, never acknowledged). Afterwards every acknowledged entry is
in the store with its exact ids, writers went on acknowledging puts to the lost master's
slots, and every submitted job was rebuilt.

The worker reads its jobs through the store's proving connections, so a node that cannot
prove ``replicas:1`` refuses them too: a master left without its replica (as a promoted one
is until its lost peer is back), or a replica that a stale slot map names as the master.
The worker waits that out as the store does, reading the slot map again between tries; the
last two tests make each refusal happen for sure. Waiting for the rebuilt records fails at
once if the worker's task ends, naming what is missing, the worker's state and the streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import ClusterNode
from redis.cluster import PRIMARY
from redis.crc import key_slot

from capture.errors import TokenCaptureError
from capture.records import TokenEntry
from tests.support.fixtures_stores import make_token_entry
from tests.support.rebuild import assert_rebuilt, finished_record, rollout_entries
from tokcap_devtools.redis_cluster import LocalCluster
from tokcap_devtools.redis_server import RedisServer
from transports.rebuild.jobs import RebuildQueue
from transports.rebuild.reader import ResultsReader
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker
from transports.redis import RedisTokenStore
from transports.redis import keys as k

pytestmark = pytest.mark.timeout(240)

PREFIX, WRITERS, SHARDS, TURNS = "fo", 12, 3, 2
OPTIONS: dict[str, Any] = dict(key_prefix=PREFIX, durability="replicas:1")
# How long the trainer waits for every rebuilt record once all jobs are queued; a worker
# whose task ended fails the test at once instead.
READ_LIMIT_S = 120
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


def replica_of(cluster: LocalCluster, master_port: int) -> RedisServer:
    """The node that replicates the master on ``master_port``."""
    for node in cluster.nodes:
        with redis.Redis(port=node.port, socket_timeout=2) as client:
            info = client.info("replication")
        if info["role"] == "slave" and int(info["master_port"]) == master_port:
            return node
    raise AssertionError(f"the master on {master_port} has no replica")


def connected_replicas(port: int) -> int:
    with redis.Redis(port=port, socket_timeout=2) as client:
        return int(client.info("replication")["connected_slaves"])


def kill_clients(port: int) -> None:
    """Close every client connection of the node on ``port``: each client opens new ones."""
    with redis.Redis(port=port, socket_timeout=2) as client:
        client.client_kill_filter(_type="normal")


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


async def put_rollouts(store: RedisTokenStore, rollout_ids: list[str]) -> None:
    """Every call of each rollout the worker will rebuild."""
    for rollout_id in rollout_ids:
        for entry in rollout_entries(rollout_id, TURNS):
            await store.put(entry)


class Reading:
    """The trainer's side: every rebuilt record read so far, so a timeout names what is missing."""

    def __init__(self, reader: ResultsReader) -> None:
        self.reader = reader
        self.records: list[dict[str, Any]] = []

    async def run(self, count: int) -> list[dict[str, Any]]:
        """Read and ack until ``count`` records came, riding out the failover's errors."""
        while len(self.records) < count:
            try:
                batch = await self.reader.read()
            except FAILURES:
                await asyncio.sleep(0.2)
                continue
            for record in batch:
                assert_rebuilt(record, TURNS)
                self.records.append(record)
                await self._ack(record)
        return self.records

    async def _ack(self, record: dict[str, Any]) -> None:
        """Ack one record, retrying while the cluster is replacing a master."""
        while True:
            try:
                await self.reader.ack(record)
                return
            except FAILURES:
                await asyncio.sleep(0.2)

    def missing(self, rollout_ids: list[str]) -> list[str]:
        """The rollouts whose rebuilt record has not been read yet."""
        read = {record["_ng_rollout_id"] for record in self.records}
        return [rollout_id for rollout_id in rollout_ids if rollout_id not in read]


class Rebuilding:
    """A rebuild worker, a submitter and a trainer reading every result, on one cluster."""

    def __init__(self, cluster: LocalCluster, jobs: list[str]) -> None:
        url = cluster.url
        self.cluster, self.jobs = cluster, jobs
        settings = WorkerSettings(
            url=url,
            cluster=True,
            shards=SHARDS,
            block_ms=100,
            claim_idle_ms=1500,  # jobs that failed during the failover come back soon
            max_attempts=100,
            **OPTIONS,
        )
        self.worker = RebuildWorker(settings)
        self.worker_task = asyncio.create_task(self.worker.run())
        self.queue = RebuildQueue(url=url, stream=settings.jobs_stream, shards=SHARDS, cluster=True)
        reader = ResultsReader(
            url=url, stream=settings.results_stream, shards=SHARDS, cluster=True, block_ms=100
        )
        self.trainer = Reading(reader)
        self.reading = asyncio.create_task(self.trainer.run(len(jobs)))

    def assert_worker_runs(self) -> None:
        assert not self.worker_task.done(), worker_state(self.worker, self.worker_task)

    def done_at_least(self, count: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            self.assert_worker_runs()
            return self.worker.counts["done"] >= count

        return check

    async def submit(self, rollout_ids: list[str]) -> None:
        """Submit each job, retrying while the cluster is replacing a master."""
        for rollout_id in rollout_ids:
            while True:
                try:
                    await self.queue.submit(finished_record(rollout_id))
                    break
                except FAILURES:
                    await asyncio.sleep(0.2)

    async def records(self, limit_s: float = READ_LIMIT_S) -> list[dict[str, Any]]:
        """Every job's rebuilt record. Past ``limit_s``, or as soon as the worker's task
        ends (nothing would rebuild the rest), the test fails naming the missing rollouts,
        the worker's state, the nodes' roles and the streams."""
        await asyncio.wait(
            [self.reading, self.worker_task],
            timeout=limit_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if self.reading.done():
            return self.reading.result()
        missing = self.trainer.missing(self.jobs)
        state = await asyncio.to_thread(queue_state, self.cluster.url, missing)
        roles = await asyncio.to_thread(node_roles, self.cluster)
        raise AssertionError(
            f"not every record was rebuilt: missing {missing}; "
            f"{worker_state(self.worker, self.worker_task)}; nodes {roles}; streams {state}"
        )

    async def close(self) -> None:
        self.worker.stop()
        await asyncio.gather(self.worker_task, return_exceptions=True)
        self.reading.cancel()
        await asyncio.gather(self.reading, return_exceptions=True)
        await self.trainer.reader.close()
        await self.queue.close()


async def rebuilding_first(cluster: LocalCluster, jobs: list[str], first: int) -> Rebuilding:
    """Every job's rollout written, then a ``Rebuilding`` that has rebuilt the first
    ``first`` jobs: a worker known to run before the fault comes (closed on failure)."""
    store = RedisTokenStore(url=cluster.url, cluster=True, **OPTIONS)
    await put_rollouts(store, jobs)
    await store.close()
    rebuilding = Rebuilding(cluster, jobs)
    try:
        await rebuilding.submit(jobs[:first])
        await eventually("the worker's first jobs", rebuilding.done_at_least(first), 60)
    except BaseException:
        await rebuilding.close()
        raise
    return rebuilding


def queue_state(url: str, missing: list[str]) -> dict[str, Any]:
    """Each shard's jobs, job errors, dead letters and results, and the missing rollouts'
    latest results: what a timed-out test reports (a cluster that cannot be read says why,
    rather than hide the failure it was asked to explain)."""
    try:
        return _read_queue_state(url, missing)
    except FAILURES as exc:
        return {"unreadable": repr(exc)}


def _read_queue_state(url: str, missing: list[str]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    with redis.RedisCluster.from_url(url, socket_timeout=5) as client:
        streams = k.shard_streams(k.stream_names(PREFIX), SHARDS, tagged=True)
        for shard in streams:
            state[shard.jobs] = _stream_state(client, shard.jobs, "rebuild")
            state[shard.jobs]["errors"] = client.hgetall(k.job_errors_key(shard.jobs))
            state[shard.dead] = [f for _, f in client.xrange(shard.dead)]
            state[shard.results] = _stream_state(client, shard.results, "trainer")
        for rollout_id in missing:
            shard = streams[k.shard_of(rollout_id, SHARDS)]
            state[rollout_id] = client.get(k.latest_result_key(shard.results, rollout_id))
    return state


def _stream_state(client: redis.RedisCluster, stream: str, group: str) -> dict[str, Any]:
    """A stream's entries (id, rollout), its groups and its group's pending entries."""
    entries = [(i, f.get(b"rollout_id")) for i, f in client.xrange(stream)]
    try:
        groups = client.xinfo_groups(stream)
        pending = client.xpending_range(stream, group, "-", "+", 100)
    except redis.ResponseError as exc:
        groups, pending = str(exc), []
    return {"entries": entries, "groups": groups, "pending": pending}


def node_roles(cluster: LocalCluster) -> dict[int, str]:
    """Each running node's port and role now, for a timed-out test's report."""
    roles = {}
    for node in cluster.nodes:
        try:
            with redis.Redis(port=node.port, socket_timeout=2) as client:
                roles[node.port] = client.info("replication")["role"]
        except redis.RedisError as exc:
            roles[node.port] = f"unreachable ({exc})"
    return roles


def worker_state(worker: RebuildWorker, worker_task: asyncio.Task[None]) -> str:
    """The worker's counts, its jobs in flight, and, when its task ended, how."""
    in_flight = [(job.streams.jobs, job.job_id) for job in worker._in_flight.values()]
    state = f"worker counts {worker.counts}, in flight {in_flight}"
    if not worker_task.done():
        return f"{state}, running"
    error = worker_task.exception()
    if error is None:
        return f"{state}, returned"
    return f"{state}, died: {''.join(traceback.format_exception(error))}"


async def test_a_killed_master_loses_no_acknowledged_put_and_everyone_reconnects(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory()
    store = RedisTokenStore(url=cluster.url, cluster=True, failover_timeout_s=20, **OPTIONS)
    jobs = [f"job-{n:02d}" for n in range(30)]
    await put_rollouts(store, jobs)  # the rollouts the worker rebuilds, written before the kill
    rebuilding = Rebuilding(cluster, jobs)
    writers = Writers(store)
    writing = [asyncio.create_task(writers.run(rollout_id)) for rollout_id in writers.acknowledged]
    try:
        await rebuilding.submit(jobs[:10])
        await eventually("5 puts per writer", writers.each_has(5), 60)
        await eventually("the worker's first jobs", rebuilding.done_at_least(3), 60)
        victim_key = k.rollout_key(PREFIX, "w0")
        victim = next(n for n in cluster.nodes if n.port == master_port_of(cluster, victim_key))
        before = {w: len(entries) for w, entries in writers.acknowledged.items()}
        victim.kill9()

        async def replaced() -> bool:
            return await asyncio.to_thread(master_port_of, cluster, victim_key) != victim.port

        await eventually("the failover to the replica", replaced, 60)
        await rebuilding.submit(jobs[10:20])
        # It rejoins as the new master's replica.
        await asyncio.to_thread(cluster.start_node, victim)
        await asyncio.to_thread(cluster.wait_healthy, 60)
        masters = await asyncio.to_thread(cluster.masters)
        assert victim.port not in {node.port for node in masters}  # back as a replica
        await rebuilding.submit(jobs[20:])
        # Writers go on by themselves: every rollout, the lost master's included, gets more.
        await eventually("5 more puts per writer", writers.each_has(max(before.values()) + 5), 60)
        writers.stop.set()
        records = await rebuilding.records()
        rebuilding.assert_worker_runs()
    finally:
        writers.stop.set()
        await asyncio.gather(*writing, return_exceptions=True)
        await rebuilding.close()
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


async def test_the_worker_waits_out_a_master_whose_connections_cannot_prove_replicas(
    redis_cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A master without its replica refuses every new connection's ``replicas:1`` proof
    (ConfigError), as a just-promoted master does until its lost peer is back, and as a
    restarted master does while it rejoins as a replica. The worker reads its jobs through
    such connections: it must wait that out, as the store's writes do, and rebuild what was
    queued meanwhile once the replica is back. It used to take the refusal for a fatal error:
    its task ended, silently, and nothing queued after a failover was rebuilt (CI saw the
    killed-master test above time out so)."""
    caplog.set_level(logging.WARNING, logger="tokcap.worker")
    cluster = redis_cluster_factory()
    jobs = [f"job-{n:02d}" for n in range(12)]
    rebuilding = await rebuilding_first(cluster, jobs, 3)
    try:
        master = master_port_of(cluster, rebuilding.queue.streams[0])
        replica = replica_of(cluster, master)
        replica.kill9()

        async def alone() -> bool:
            return await asyncio.to_thread(connected_replicas, master) == 0

        await eventually("the master losing its replica", alone, 30)
        await asyncio.to_thread(kill_clients, master)  # the worker must connect anew

        async def refused() -> bool:
            rebuilding.assert_worker_runs()
            said = [r.getMessage() for r in caplog.records if r.name == "tokcap.worker"]
            return any("0 connected replicas" in message for message in said)

        await eventually("the worker meeting the refused proof", refused, 30)
        await rebuilding.submit(jobs[3:])
        await asyncio.to_thread(cluster.start_node, replica)
        await asyncio.to_thread(cluster.wait_healthy, 60)
        records = await rebuilding.records()
        rebuilding.assert_worker_runs()
    finally:
        await rebuilding.close()
    assert sorted(r["_ng_rollout_id"] for r in records) == jobs


async def test_the_worker_reads_the_slot_map_again_when_it_names_a_replica(
    redis_cluster_factory,
) -> None:
    """A slot map read from a node with a stale view (a killed master restarting, before it
    learns it was replaced) names a replica as a slot's master. The replica refuses the
    worker's new connection (ConfigError: a slave) before any command could answer MOVED,
    so only reading the map again, as the store does between its tries, routes the worker
    right; the worker's task ended on exactly this refusal in CI's failed run."""
    cluster = redis_cluster_factory()
    jobs = [f"job-{n:02d}" for n in range(9)]
    rebuilding = await rebuilding_first(cluster, jobs, 3)
    try:
        stream = rebuilding.queue.streams[0]
        replica = replica_of(cluster, master_port_of(cluster, stream))
        manager = rebuilding.worker.client.nodes_manager
        # The map a stale node gives: the shard's replica as the master of its slot.
        stale = ClusterNode("127.0.0.1", replica.port, PRIMARY, **manager.connection_kwargs)
        manager.slots_cache[key_slot(stream.encode())] = [stale]
        await rebuilding.submit(jobs[3:])
        records = await rebuilding.records(limit_s=30)
        rebuilding.assert_worker_runs()
    finally:
        await rebuilding.close()
    assert sorted(r["_ng_rollout_id"] for r in records) == jobs
