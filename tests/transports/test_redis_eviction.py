"""A Redis that may evict is refused (issue 26): at start-up and on every new connection.

Each case runs its own redis-server with the policy under test (the cluster case switches
one master of the session cluster and switches it back), so the message a user sees is the
one these tests read.
"""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from capture.errors import ConfigError
from tests.support.fixtures_stores import make_token_entry
from transports.rebuild.jobs import RebuildQueue
from transports.rebuild.reader import ResultsReader
from transports.redis import RedisTokenStore
from transports.redis.eviction import EvictingRedisError, Memory, refuse_eviction

FIX = "set maxmemory-policy noeviction"


def _dbsize(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return client.dbsize()


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
async def test_allkeys_policies_are_refused_before_any_write(redis_server_factory, policy):
    server = redis_server_factory(**{"maxmemory-policy": policy, "maxmemory": "64mb"})
    store = RedisTokenStore(url=server.url)
    with pytest.raises(EvictingRedisError, match=f"maxmemory-policy {policy}.*{FIX}") as caught:
        await store.put(make_token_entry("refused", "c-1"))
    assert "rollouts being written" in str(caught.value)
    assert f"127.0.0.1:{server.port}" in str(caught.value)
    assert _dbsize(server.url) == 0
    await store.close()


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-ttl"])
async def test_volatile_policies_are_refused_for_the_keys_with_a_ttl(redis_server_factory, policy):
    """Tombstones, kept evidence and publish guards carry a TTL; evicted early, a late write
    recreates a retired rollout and a re-run job publishes twice (see eviction.py)."""
    server = redis_server_factory(**{"maxmemory-policy": policy})
    store = RedisTokenStore(url=server.url)
    with pytest.raises(EvictingRedisError, match=f"{policy}.*tombstones.*{FIX}"):
        await store.check()
    await store.close()


async def test_noeviction_is_accepted_and_its_memory_is_read(redis_server_factory):
    server = redis_server_factory(**{"maxmemory": "32mb"})
    async with RedisTokenStore(url=server.url) as store:
        await store.put(make_token_entry("kept", "c-1"))
        (memory,) = await store.memory()
    assert memory.policy == "noeviction" and memory.max_bytes == 32 * 1024 * 1024
    assert 0 < memory.used_bytes < memory.max_bytes
    assert memory.where == f"redis at 127.0.0.1:{server.port}"
    assert 0 < memory.as_dict()["used_fraction"] < 1


async def test_the_durability_opt_out_does_not_opt_out_of_eviction(redis_server_factory):
    server = redis_server_factory(appendonly="no", **{"maxmemory-policy": "allkeys-lru"})
    store = RedisTokenStore(url=server.url, durability="none")
    with pytest.raises(EvictingRedisError, match=FIX):
        await store.put(make_token_entry("refused", "c-1"))
    assert _dbsize(server.url) == 0
    await store.close()


async def test_the_policy_is_read_where_config_is_disabled(redis_server_factory):
    """Managed services disable CONFIG; INFO memory still names the policy."""
    server = redis_server_factory(
        **{"rename-command": ("CONFIG", ""), "maxmemory-policy": "allkeys-lru"}
    )
    store = RedisTokenStore(url=server.url, durability="none")
    with pytest.raises(EvictingRedisError, match="allkeys-lru"):
        await store.check()
    await store.close()


async def test_a_policy_set_while_running_refuses_the_next_connection(redis_server_factory):
    """The operator switches to allkeys-lru under a running store: connections already
    proven were cut (here by CLIENT KILL), and the next one refuses the server."""
    server = redis_server_factory()
    store = RedisTokenStore(url=server.url, max_retries=0)
    await store.put(make_token_entry("running", "c-1"))
    admin = aioredis.Redis.from_url(server.url)
    try:
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        await admin.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(EvictingRedisError, match="allkeys-lru"):
            await store.put(make_token_entry("running", "c-2"))
        assert await admin.hexists(f"{store.key_prefix}:{{running}}", "e:c-1")
        assert not await admin.hexists(f"{store.key_prefix}:{{running}}", "e:c-2")
    finally:
        await admin.aclose()
        await store.close()


async def test_queues_and_results_readers_refuse_an_evicting_redis(redis_server_factory):
    server = redis_server_factory(**{"maxmemory-policy": "allkeys-lru"})
    async with RebuildQueue(url=server.url) as queue:
        with pytest.raises(EvictingRedisError):
            await queue.submit({"_ng_rollout_id": "r-1", "response": {"output": []}})
    async with ResultsReader(url=server.url, block_ms=1) as reader:
        with pytest.raises(EvictingRedisError):
            await reader.read()
    async with ResultsReader(url=server.url, shards=2, block_ms=1) as reader:
        with pytest.raises(EvictingRedisError):
            await reader.read()
    assert _dbsize(server.url) == 0


async def test_every_master_of_a_cluster_proves_it_keeps_its_keys(redis_cluster, redis_prefix):
    """One master of three switched to allkeys-lru: a store starting then is refused,
    naming that master; switched back, the same store starts."""
    master = redis_cluster.masters()[1]
    with redis.Redis(host="127.0.0.1", port=master.port) as admin:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        try:
            store = RedisTokenStore(url=redis_cluster.url, cluster=True, key_prefix=redis_prefix)
            with pytest.raises(EvictingRedisError, match=f"127.0.0.1:{master.port}"):
                await store.check()
            await store.close()
        finally:
            admin.config_set("maxmemory-policy", "noeviction")
    async with RedisTokenStore(
        url=redis_cluster.url, cluster=True, key_prefix=redis_prefix
    ) as store:
        await store.check()
        memories = await store.memory()
    assert len(memories) == 3 and {m.policy for m in memories} == {"noeviction"}


def test_an_unknown_policy_is_refused_too():
    with pytest.raises(ConfigError, match="names no maxmemory_policy"):
        refuse_eviction(Memory("redis at h:1", 10, 0, ""))
    refuse_eviction(Memory("redis at h:1", 10, 0, "noeviction"))
