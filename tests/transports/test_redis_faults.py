"""Faults and races against real redis-server processes: nothing acknowledged is ever lost.

A server killed with SIGKILL mid-load and restarted on its data dir still holds every put
that returned; a put that raised is absent or whole. Freezes racing puts, and writers in
several processes, keep the contract. An unreachable server makes puts and losses raise.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from capture.errors import ConfigError, RolloutFrozenError
from tests.support.fixtures_stores import make_token_entry
from tests.support.rollouts import growing_rollout
from tests.support.servers import free_port
from transports.redis import RedisTokenStore, RedisUnavailableError


async def test_put_to_an_unreachable_server_raises(redis_prefix):
    store = RedisTokenStore(
        url=f"redis://127.0.0.1:{free_port()}/0",
        key_prefix=redis_prefix,
        max_retries=2,
        connect_timeout_s=0.5,
    )
    with pytest.raises(RedisUnavailableError, match="unreachable after 3 attempts"):
        await store.put(make_token_entry("nowhere", "c-1"))
    with pytest.raises(RedisUnavailableError):
        await store.mark_incomplete("nowhere", "c-1")
    await store.close()


async def test_mark_incomplete_raises_after_bounded_retries_once_redis_dies(
    redis_server_factory, redis_prefix
):
    server = redis_server_factory()
    store = RedisTokenStore(
        url=server.url, key_prefix=redis_prefix, max_retries=3, connect_timeout_s=0.5
    )
    await store.put(make_token_entry("dies", "c-1"))
    server.kill9()
    with pytest.raises(RedisUnavailableError, match="after 4 attempts"):
        await store.mark_incomplete("dies", "c-2")
    server.start()  # same port, same data dir: the acknowledged put survived
    snapshot = await store.freeze("dies")
    assert [e.model_call_id for e in snapshot.entries] == ["c-1"]
    await store.close()


async def test_kill9_under_load_loses_no_acknowledged_put(redis_server_factory, redis_prefix):
    server = redis_server_factory()
    store = RedisTokenStore(
        url=server.url,
        key_prefix=redis_prefix,
        max_retries=0,
        connect_timeout_s=0.5,
        socket_timeout_s=2,
    )
    rollouts = {
        f"crash-{n:02d}": growing_rollout(
            f"crash-{n:02d}",
            6,
            system_tokens=300,
            generated_per_turn=20,
            tool_tokens_per_turn=40,
            seed=n,
        )
        for n in range(50)
    }
    # Each of 8 writers owns a slice of the rollouts and walks them turn by turn.
    work = [
        entry for turn in range(6) for entries in rollouts.values() for entry in [entries[turn]]
    ]
    acked: list = []
    raised: list = []
    killed = asyncio.Event()

    async def writer(index: int) -> None:
        for entry in work[index::8]:
            try:
                await store.put(entry)
            except Exception:
                raised.append(entry)
            else:
                acked.append(entry)
            if len(acked) >= 120 and not killed.is_set():
                killed.set()
                server.kill9()

    await asyncio.gather(*(writer(i) for i in range(8)))
    await store.close()
    assert killed.is_set() and raised, "the crash must happen while writers are running"

    server.start()
    reader = RedisTokenStore(url=server.url, key_prefix=redis_prefix)
    snapshots = {rid: await reader.freeze(rid) for rid in rollouts}
    stored = {(e.rollout_id, e.model_call_id): e for s in snapshots.values() for e in s.entries}
    for entry in acked:
        got = stored.get((entry.rollout_id, entry.model_call_id))
        assert got is not None, f"acknowledged {entry.rollout_id}/{entry.model_call_id} lost"
        assert got.model_dump() == entry.model_dump()
    for entry in raised:
        got = stored.get((entry.rollout_id, entry.model_call_id))
        assert got is None or got.model_dump() == entry.model_dump()
    await reader.close()


async def test_500_freezes_racing_puts_lose_nothing(redis_url, redis_prefix):
    store = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    late = 0
    rng = random.Random(500)
    for round_number in range(500):
        rollout_id = f"round-{round_number}"
        entries = [
            make_token_entry(rollout_id, f"c-{i}", prompt=[round_number, i] * 150) for i in range(3)
        ]

        async def put(entry, delay):
            # A put is one round trip and a freeze two, so puts sent at once always land
            # first; a random delay of up to a freeze's length makes them race for real.
            await asyncio.sleep(delay)
            await store.put(entry)
            return entry.model_call_id

        *outcomes, snapshot = await asyncio.gather(
            *(put(entry, rng.uniform(0, 0.003)) for entry in entries),
            store.freeze(rollout_id),
            return_exceptions=True,
        )
        assert not isinstance(snapshot, BaseException), snapshot
        acknowledged = {o for o in outcomes if isinstance(o, str)}
        refused = [o for o in outcomes if not isinstance(o, str)]
        assert all(isinstance(error, RolloutFrozenError) for error in refused), refused
        in_snapshot = {e.model_call_id for e in snapshot.entries}
        if not acknowledged <= in_snapshot:  # allowed only if the drop then fails
            assert not await store.drop(
                rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version
            )
        final = await store.freeze(rollout_id)
        assert acknowledged <= {e.model_call_id for e in final.entries}
        late += len(refused)
        assert await store.drop(rollout_id, snapshot_id=final.snapshot_id, version=final.version)
    await store.close()
    assert late > 0, "no put ever lost the race; the test did not race"


WRITER = textwrap.dedent("""
    import asyncio, json, sys
    from tests.support.fixtures_stores import make_token_entry
    from transports.redis import RedisTokenStore

    async def main(url, prefix, worker):
        store = RedisTokenStore(url=url, key_prefix=prefix)
        shared = list(range(900))  # every process writes the same prefix blocks
        for i in range(25):
            await store.put(make_token_entry("multi", f"w{worker}-{i:02d}",
                                             prompt=shared + [worker, i], generation=[i],
                                             log_probs=[-1.0], created_at=1.0))
        common = make_token_entry("multi", "common", prompt=shared, generation=[1],
                                  log_probs=[-1.0], created_at=2.0)
        await store.put(common)  # the same call from every process: one entry
        await store.close()
        print(json.dumps({"worker": worker, "ok": True}))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


async def test_several_writer_processes_on_one_rollout(redis_url, redis_prefix):
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WRITER,
            redis_url,
            redis_prefix,
            str(worker),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for worker in range(4)
    ]
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)["ok"] is True
    store = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    info = await store.inspect("multi")
    assert info["calls"] == 4 * 25 + 1
    snapshot = await store.freeze("multi")
    assert snapshot.incomplete is False
    ids = [e.model_call_id for e in snapshot.entries]
    assert ids == sorted(ids) and len(set(ids)) == 101
    for entry in snapshot.entries:
        if entry.model_call_id != "common":
            worker, i = entry.model_call_id[1:].split("-")
            assert entry.prompt_token_ids == list(range(900)) + [int(worker), int(i)]
    await store.close()


async def test_more_writers_than_connections_wait_for_one(redis_url, redis_prefix):
    # redis-py's default pool fails at once when it is exhausted; this one waits its turn.
    store = RedisTokenStore(url=redis_url, key_prefix=redis_prefix, max_connections=4)
    entries = [make_token_entry(f"crowd-{n % 20}", f"c-{n:03d}") for n in range(300)]
    await asyncio.gather(*(store.put(entry) for entry in entries))
    stored = 0
    for n in range(20):
        stored += len((await store.freeze(f"crowd-{n}")).entries)
    assert stored == 300
    assert len(store._reach.client.connection_pool._in_use_connections) == 0
    await store.close()


async def test_the_wait_for_a_connection_is_bounded(redis_url, redis_prefix):
    store = RedisTokenStore(
        url=redis_url,
        key_prefix=redis_prefix,
        max_connections=1,
        pool_timeout_s=0.2,
        max_retries=1,
    )
    await store.check()
    pool = store._reach.client.connection_pool
    held = await pool.get_connection()  # the only connection, taken by someone else
    try:
        with pytest.raises(RedisUnavailableError, match="No connection available"):
            await store.put(make_token_entry("starved", "c-1"))
    finally:
        await pool.release(held)
    await store.put(make_token_entry("starved", "c-1"))  # and it recovers once freed
    await store.close()


async def test_a_server_that_comes_back_without_aof_is_refused(redis_server_factory, redis_prefix):
    server = redis_server_factory()
    store = RedisTokenStore(
        url=server.url, key_prefix=redis_prefix, max_retries=1, connect_timeout_s=0.5
    )
    await store.put(make_token_entry("reproven", "c-1"))
    server.kill9()
    server.options["appendonly"] = "no"
    server.start()
    # The store reconnects by itself, and the new connection has to prove durability again.
    with pytest.raises(ConfigError, match="AOF is off"):
        await store.put(make_token_entry("reproven", "c-2"))
    with pytest.raises(ConfigError, match="AOF is off"):
        await store.mark_incomplete("reproven", "c-2")
    server.kill9()
    server.options["appendonly"] = "yes"
    server.start()
    await store.put(make_token_entry("reproven", "c-3"))
    snapshot = await store.freeze("reproven")
    assert [e.model_call_id for e in snapshot.entries] == ["c-1", "c-3"]
    await store.close()


async def test_a_server_that_comes_back_without_its_replicas_is_refused(
    redis_server_factory, redis_prefix
):
    primary = redis_server_factory()
    replica = redis_server_factory(replicaof=("127.0.0.1", str(primary.port)))
    store = RedisTokenStore(
        url=primary.url,
        key_prefix=redis_prefix,
        durability="replicas:1",
        max_retries=1,
        connect_timeout_s=0.5,
    )
    with redis.Redis.from_url(primary.url) as client:
        deadline = time.monotonic() + 10
        while client.wait(1, 100) < 1:  # replication flows once the replica acks
            assert time.monotonic() < deadline, "replica did not connect"
    await store.put(make_token_entry("replicated", "c-1"))
    replica.kill9()
    primary.kill9()
    primary.start()
    with pytest.raises(ConfigError, match="replicas"):
        await store.put(make_token_entry("replicated", "c-2"))
    await store.close()
