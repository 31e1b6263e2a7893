"""The start-up durability check: a server that cannot prove the guarantee is refused.

Each case runs its own redis-server with the setting under test, so the message a user sees
is the one these tests read.
"""

from __future__ import annotations

import logging
import time

import pytest
import redis
import redis.asyncio as aioredis

from capture.delivery import finalize_rollout_token_capture
from capture.errors import ConfigError
from tests.support.fixtures_stores import make_token_entry
from transports.redis import RedisTokenStore
from transports.redis.durability import Durability, DurabilityError, check_durability


def _version(url: str) -> tuple[int, int]:
    with redis.Redis.from_url(url) as client:
        major, minor = client.info("server")["redis_version"].split(".")[:2]
    return int(major), int(minor)


def _dbsize(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return client.dbsize()


async def test_aof_always_is_accepted(redis_server_factory):
    server = redis_server_factory()
    store = RedisTokenStore(url=server.url)
    proof = await store.start()
    assert proof.how == "appendfsync always" and proof.wait == ()
    await store.close()


async def test_aof_off_is_refused_before_any_write(redis_server_factory):
    server = redis_server_factory(appendonly="no")
    store = RedisTokenStore(url=server.url)
    with pytest.raises(ConfigError, match="AOF is off.*set appendonly yes and appendfsync always"):
        await store.put(make_token_entry("refused", "c-1"))
    assert _dbsize(server.url) == 0
    await store.close()


async def test_everysec_is_refused_without_waitaof(redis_server_factory):
    server = redis_server_factory(appendfsync="everysec")
    store = RedisTokenStore(url=server.url)
    if _version(server.url) >= (7, 2):  # WAITAOF proves each write's fsync instead
        assert (await store.check()).how == "WAITAOF 1 0"
        await store.put(make_token_entry("waitaof", "c-1"))
    else:
        with pytest.raises(ConfigError, match="appendfsync is 'everysec'.*appendfsync always"):
            await store.check()
    await store.close()


async def test_config_disabled_asks_for_an_explicit_mode(redis_server_factory):
    server = redis_server_factory(**{"rename-command": ("CONFIG", "")})
    store = RedisTokenStore(url=server.url)
    if _version(server.url) >= (7, 2):
        assert (await store.check()).how == "WAITAOF 1 0"  # INFO shows AOF on; WAITAOF proves
    else:
        with pytest.raises(ConfigError, match="CONFIG is disabled.*choose a durability mode"):
            await store.check()
    await store.close()


async def test_none_is_a_logged_opt_out(redis_server_factory, caplog):
    server = redis_server_factory(appendonly="no")
    store = RedisTokenStore(url=server.url, durability="none")
    with caplog.at_level(logging.WARNING, logger="tokcap.redis"):
        await store.put(make_token_entry("opt-out", "c-1"))
    assert any("durability='none'" in record.getMessage() for record in caplog.records)
    assert len((await store.freeze("opt-out")).entries) == 1
    await store.close()


async def test_replicas_mode_waits_for_a_real_replica(redis_server_factory):
    primary = redis_server_factory(**{"repl-diskless-sync-delay": "0"})
    refused = RedisTokenStore(url=primary.url, durability="replicas:1")
    with pytest.raises(ConfigError, match="0 connected replicas.*attach at least 1"):
        await refused.check()
    await refused.close()

    replica = redis_server_factory(replicaof=("127.0.0.1", str(primary.port)))
    with redis.Redis.from_url(primary.url) as client:
        deadline = time.monotonic() + 20
        client.set("probe", 1)
        while client.wait(1, 100) < 1:  # replication flows once the replica acks
            assert time.monotonic() < deadline, "replica did not connect"
            client.set("probe", 1)
    store = RedisTokenStore(url=primary.url, durability="replicas:1", wait_timeout_ms=300)
    assert (await store.check()).wait == (("WAIT", 1, 300),)
    entry = make_token_entry("replicated", "c-1")
    await store.put(entry)
    with redis.Redis.from_url(replica.url) as client:
        assert client.hexists("tokcap:{replicated}", "e:c-1")

    replica.kill9()  # the replica is gone: the next write cannot be confirmed
    late = make_token_entry("replicated", "c-2")
    with pytest.raises(DurabilityError, match="0 of 1 replicas"):
        await store.put(late)
    # Stored on the primary, though unconfirmed; a freeze is a write, so it fails the same way.
    assert (await store.inspect("replicated"))["calls"] == 2
    # A retry of the unconfirmed put finds its payload stored, and still needs the proof.
    with pytest.raises(DurabilityError, match="0 of 1 replicas"):
        await store.put(late)
    with pytest.raises(DurabilityError):
        await store.freeze("replicated")
    # Through finalize, the unconfirmed freeze is the source's error (a worker retries the
    # job), not a failed build that would be published masked.
    record = {"_ng_rollout_id": "replicated", "response": {"output": []}, "reward": 1.0}
    built = await finalize_rollout_token_capture(record, store)
    assert built.error_kind == "source" and "0 of 1 replicas" in built.error
    await store.close()


async def test_check_accepts_redis_py_parsed_replies(redis_server_factory):
    """Other parts call the check through a plain client, whose replies are parsed dicts."""
    server = redis_server_factory()
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    proof = await check_durability(
        client.execute_command, Durability.parse("fsync"), where=server.url, wait_timeout_ms=100
    )
    assert proof.how == "appendfsync always"
    await client.aclose()


def test_durability_strings():
    assert Durability.parse("replicas:2").replicas == 2
    for bad in ("replicas:0", "replicas:", "fsync ", "always"):
        with pytest.raises(ConfigError, match="'fsync', 'replicas:N'"):
            Durability.parse(bad)
