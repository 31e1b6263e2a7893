"""The store and the rebuild queue on a real Redis Cluster: 3 masters, 1 replica each.

The store-contract suite runs against the session's cluster through the ``redis-cluster``
store kind (``tests.support.fixtures_stores``); here are the cluster's own properties: a
rollout lives on the master of its slot, rollouts spread over every master, every worker
reads every shard of the queue, a trainer reads every shard of the results, and settings
that cannot work are refused with a message. The failover tests are in
``test_redis_cluster_failover``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from capture.config import TokenIdCaptureConfig
from capture.errors import ConfigError
from tests.support.rebuild import assert_rebuilt, finished_record, rollout_entries
from tokcap_devtools.redis_cluster import LocalCluster
from transports.rebuild.jobs import RebuildQueue
from transports.rebuild.reader import ResultsReader
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker
from transports.redis import RedisTokenStore
from transports.redis import keys as k
from transports.redis.keys import as_text

pytestmark = pytest.mark.timeout(180)


def keys_on(port: int, pattern: str) -> list[bytes]:
    """The keys one node holds that match ``pattern`` (its own, not the cluster's)."""
    with redis.Redis(port=port, socket_timeout=5) as client:
        return list(client.scan_iter(match=pattern, count=1000))


async def test_settings_that_cannot_work_on_a_cluster_are_refused() -> None:
    with pytest.raises(ConfigError, match="over TCP"):
        RedisTokenStore(url="unix:///tmp/redis.sock", cluster=True)
    with pytest.raises(ConfigError, match="cluster must be true or false"):
        RedisTokenStore(url="redis://127.0.0.1:1/0", cluster="yes")
    plain = aioredis.Redis(port=1)
    with pytest.raises(ConfigError, match="RedisCluster client"):
        RedisTokenStore(client=plain, cluster=True)
    await plain.aclose()
    with pytest.raises(ValueError, match="shards must be"):
        RebuildQueue(url="redis://127.0.0.1:1/0", shards=0)
    with pytest.raises(ValueError, match="braces"):
        WorkerSettings(url="redis://127.0.0.1:1/0", jobs_stream="{q}:jobs", shards=2)


async def test_a_connected_cluster_client_is_refused_a_fresh_one_is_taken(
    redis_cluster: LocalCluster, redis_prefix: str, make_entry
) -> None:
    connected = RedisCluster.from_url(redis_cluster.url)
    await connected.initialize()
    with pytest.raises(ConfigError, match="has not connected yet"):
        await RedisTokenStore(client=connected, key_prefix=redis_prefix).check()
    await connected.aclose()
    fresh = RedisCluster.from_url(redis_cluster.url)
    async with RedisTokenStore(client=fresh, key_prefix=redis_prefix) as store:
        assert store.cluster
        await store.put(make_entry("given-1", "c1"))
        assert len((await store.freeze("given-1")).entries) == 1
    await fresh.aclose()


async def test_a_config_puts_the_sink_on_the_cluster(
    redis_cluster: LocalCluster, redis_prefix: str, make_entry
) -> None:
    config = TokenIdCaptureConfig.from_block(
        {
            "enabled": True,
            "sink": "transports.redis:RedisTokenSink",
            "sink_kwargs": {"url": redis_cluster.url, "cluster": True, "key_prefix": redis_prefix},
        }
    )
    sink = config.build_sink()
    try:
        assert sink.cluster
        await sink.put(make_entry("config-1", "c1"))
        assert (await sink.inspect("config-1"))["calls"] == 1
    finally:
        await sink.close()
    wrong = TokenIdCaptureConfig.from_block(
        {
            "enabled": True,
            "sink": "transports.redis:RedisTokenSink",
            "sink_kwargs": {"url": redis_cluster.url, "cluster": "yes"},
        }
    )
    with pytest.raises(ConfigError, match="cluster must be true or false"):
        wrong.build_sink()


async def test_one_redis_takes_a_sharded_queue_too(redis_url: str, redis_prefix: str) -> None:
    """Shards are not only for a cluster: on one Redis they are hash-tagged streams as well."""
    rollout_ids = [f"one-{n}" for n in range(6)]
    async with RedisTokenStore(url=redis_url, key_prefix=redis_prefix) as store:
        for rollout_id in rollout_ids:
            for entry in rollout_entries(rollout_id, 2):
                await store.put(entry)
    base = k.stream_names(redis_prefix)
    async with RebuildQueue(url=redis_url, stream=base.jobs, shards=2) as queue:
        for rollout_id in rollout_ids:
            await queue.submit(finished_record(rollout_id))
        assert {queue.stream_of(r) for r in rollout_ids} == set(queue.streams)
    worker = RebuildWorker(
        WorkerSettings(url=redis_url, key_prefix=redis_prefix, shards=2, block_ms=50)
    )
    task = asyncio.create_task(worker.run())
    records = []
    try:
        async with ResultsReader(
            url=redis_url, stream=base.results, shards=2, block_ms=50
        ) as reader:
            while len(records) < len(rollout_ids):
                assert not task.done(), task
                for record in await reader.read():
                    assert_rebuilt(record, 2)
                    assert await reader.ack(record["_ng_result_id"])  # by id: it knows the shard
                    records.append(record)
    finally:
        worker.stop()
        await task
    assert sorted(r["_ng_rollout_id"] for r in records) == rollout_ids


async def test_two_hundred_rollouts_spread_over_every_master(
    redis_cluster: LocalCluster, redis_prefix: str
) -> None:
    rollout_ids = [f"spread-{n:03d}" for n in range(200)]
    async with RedisTokenStore(
        url=redis_cluster.url, cluster=True, key_prefix=redis_prefix
    ) as store:
        assert (await store.check()).how == "appendfsync always"

        async def write(rollout_id: str) -> None:
            for entry in rollout_entries(rollout_id, 2):
                await store.put(entry)

        await asyncio.gather(*(write(rollout_id) for rollout_id in rollout_ids))
        held = {
            master.port: keys_on(master.port, k.rollout_pattern(redis_prefix))
            for master in redis_cluster.masters()
        }
        assert len(held) == 3 and all(held.values()), {p: len(v) for p, v in held.items()}
        assert sum(len(keys) for keys in held.values()) == 200
        for rollout_id in rollout_ids[::20]:
            snapshot = await store.freeze(rollout_id)
            assert [e.model_call_id for e in snapshot.entries] == [
                e.model_call_id for e in rollout_entries(rollout_id, 2)
            ]
            assert snapshot.entries[-1].prompt_token_ids == (
                rollout_entries(rollout_id, 2)[-1].prompt_token_ids
            )


async def test_workers_rebuild_across_every_shard_and_the_trainer_reads_them_all(
    redis_cluster: LocalCluster, redis_prefix: str
) -> None:
    url, shards, turns = redis_cluster.url, 3, 3
    rollout_ids = [f"shard-{n:02d}" for n in range(24)]
    async with RedisTokenStore(url=url, cluster=True, key_prefix=redis_prefix) as store:
        for rollout_id in rollout_ids:
            for entry in rollout_entries(rollout_id, turns):
                await store.put(entry)
    jobs_base = k.stream_names(redis_prefix).jobs
    async with RebuildQueue(url=url, stream=jobs_base, shards=shards, cluster=True) as queue:
        for rollout_id in rollout_ids:
            await queue.submit(finished_record(rollout_id))
        assert await queue.pending() == len(rollout_ids)
        # Each shard's stream lives on a master of its own.
        homes = {
            master.port
            for stream in queue.streams
            for master in redis_cluster.masters()
            if keys_on(master.port, stream)
        }
        assert len(homes) == shards
    workers = [
        RebuildWorker(
            WorkerSettings(
                url=url,
                key_prefix=redis_prefix,
                cluster=True,
                shards=shards,
                consumer=f"w{n}",
                concurrency=2,
                block_ms=100,
            )
        )
        for n in range(2)
    ]
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    results_base = k.stream_names(redis_prefix).results
    records: list[dict[str, Any]] = []
    try:
        async with ResultsReader(
            url=url, stream=results_base, shards=shards, cluster=True, block_ms=100
        ) as reader:
            while len(records) < len(rollout_ids):
                for task in tasks:
                    assert not task.done(), task  # a worker that stopped would hang the test
                for record in await reader.read():
                    assert_rebuilt(record, turns)
                    assert await reader.ack(record)
                    records.append(record)
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*tasks)
    assert sorted(r["_ng_rollout_id"] for r in records) == rollout_ids
    assert sum(worker.counts["retired"] for worker in workers) == len(rollout_ids)
    # Both workers read from more than one shard; every job stream is drained.
    async with RebuildQueue(url=url, stream=jobs_base, shards=shards, cluster=True) as queue:
        assert await queue.pending() == 0


async def test_submit_command_queues_on_the_cluster_shards(
    redis_cluster: LocalCluster, redis_prefix: str, tmp_path, capsys
) -> None:
    from tokcap.commands import submit

    path = tmp_path / "records.jsonl"
    rollout_ids = [f"cli-{n}" for n in range(6)]
    path.write_text("\n".join(json.dumps(finished_record(r)) for r in rollout_ids))
    where = ["--url", redis_cluster.url, "--cluster", "--key-prefix", redis_prefix]
    code = await asyncio.to_thread(submit.main, [*where, "--shards", "3", str(path)])
    assert code == 0, capsys.readouterr().err
    base = k.stream_names(redis_prefix).jobs
    async with RebuildQueue(url=redis_cluster.url, stream=base, shards=3, cluster=True) as queue:
        assert await queue.pending() == len(rollout_ids)
        for rollout_id in rollout_ids:
            entries = await queue.client.xrange(queue.stream_of(rollout_id))
            assert rollout_id in {as_text(fields[b"rollout_id"]) for _, fields in entries}
    code = await asyncio.to_thread(submit.main, [*where, "--shards", "0", str(path)])
    assert code == 2 and "shards must be" in capsys.readouterr().err


def test_a_node_whose_port_another_redis_took_is_refused(redis_server_factory, tmp_path) -> None:
    """A port taken between its choice and the node's start must not bring a foreign Redis
    into the cluster (redis-cli --cluster create would reconfigure it)."""
    foreign = redis_server_factory()
    cluster = LocalCluster(tmp_path / "cluster", masters=1, replicas=0)
    (node,) = cluster.nodes
    node.port = foreign.port
    try:
        with pytest.raises(RuntimeError, match="served by another process"):
            cluster.start_node(node)
    finally:
        cluster.stop()
    with redis.Redis(port=foreign.port) as client:
        assert client.ping() and client.info("cluster")["cluster_enabled"] == 0


def test_the_ports_of_a_local_cluster_are_all_different(tmp_path) -> None:
    cluster = LocalCluster(tmp_path / "cluster")
    ports = [node.port for node in cluster.nodes]
    ports += [int(node.options["cluster-port"]) for node in cluster.nodes]
    assert len(set(ports)) == 12
