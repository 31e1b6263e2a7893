"""What only the Redis store promises: its layout, construction, and what crosses the wire.

The shared contract runs against Redis from tests/capture/test_store_contract.py; these tests cover
the rest: one hash per rollout in one Cluster slot, blocks sent once, construction from
kwargs or a client or the config loader, foreign entry objects, the tombstone TTL.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import redis
import redis.asyncio as aioredis

from capture.codec.views import IdView
from capture.config import load_capture_config
from capture.errors import ConfigError, RolloutFrozenError
from capture.protocols import IntentSink, TokenSink, TokenSource
from capture.routes import Routes
from tests.support.fixtures_stores import make_token_entry
from tests.support.rollouts import growing_rollout
from tests.support.routes import rollout
from transports.redis import RedisTokenSink, RedisTokenSource, RedisTokenStore
from transports.redis.keys import rollout_key


@pytest.fixture
async def store(redis_url, redis_prefix):
    made = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    yield made
    await made.close()


@pytest.fixture
def raw(redis_url):
    with redis.Redis.from_url(redis_url) as client:
        yield client


def crc16_xmodem(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), as the Redis Cluster spec defines the key hash."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def cluster_slot(key: bytes) -> int:
    """The Cluster slot of a key: only the text inside the first non-empty {...} counts."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16_xmodem(key) % 16384


def test_crc16_matches_the_cluster_spec_example():
    assert crc16_xmodem(b"123456789") == 0x31C3  # the spec's reference value


async def test_all_keys_of_a_rollout_share_one_cluster_slot(store, raw, redis_prefix):
    rollout_id = "slot-check.7"
    for turn, entry in enumerate(_rollout(rollout_id, turns=3)):
        await store.put(entry)
        await store.begin_call(rollout_id, f"extra-{turn}")
    await store.mark_incomplete(rollout_id, "extra-0")
    keys = list(raw.scan_iter(match=f"{redis_prefix}:*"))
    assert keys == [rollout_key(redis_prefix, rollout_id).encode()]  # one hash, nothing else
    tag_slot = crc16_xmodem(rollout_id.encode()) % 16384
    assert {cluster_slot(key) for key in keys} == {tag_slot}
    from redis.cluster import key_slot

    assert {key_slot(key) for key in keys} == {tag_slot}


async def test_one_hash_with_state_entry_and_block_fields(store, raw, redis_prefix):
    entries = _rollout("layout", turns=4)
    for entry in entries:
        await store.put(entry)
    await store.begin_call("layout", "pending")
    fields = raw.hgetall(rollout_key(redis_prefix, "layout"))
    names = {name.decode() for name in fields}
    assert {"version", "e:turn-00000", "d:turn-00000", "e:turn-00003", "i:pending"} <= names
    blocks = [value for name, value in fields.items() if name.startswith(b"b:")]
    # Each id of the final sequence is stored once: later calls extend earlier blocks, and
    # a generation lives in the blocks the next prompt shares. 33 bytes of header per block.
    final = entries[-1]
    ids = len(final.prompt_token_ids) + len(final.generation_token_ids)
    assert sum(len(value) for value in blocks) <= 4 * ids + 33 * len(blocks)
    assert len(blocks) <= ids // 250 + len(entries)


async def test_only_missing_blocks_cross_the_wire(redis_server_factory, redis_prefix):
    server = redis_server_factory()
    store = RedisTokenStore(url=server.url, key_prefix=redis_prefix)
    long_prompt = list(range(20_000))  # 80 kB of packed ids
    first = make_token_entry("wire", "c-1", prompt=long_prompt, generation=[1])
    second = make_token_entry("wire", "c-2", prompt=long_prompt + [5] * 300, generation=[2])
    with redis.Redis.from_url(server.url) as raw:
        await store.check()
        before = raw.info("stats")["total_net_input_bytes"]
        await store.put(first)
        middle = raw.info("stats")["total_net_input_bytes"]
        await store.put(second)
        after = raw.info("stats")["total_net_input_bytes"]
    await store.close()
    assert middle - before > 80_000  # the first put sends the whole prompt
    assert after - middle < 12_000  # the second sends its new tail block, and names


async def test_foreign_entry_objects_are_accepted(store):
    class GymEntry:  # NeMo Gym's TokenEntry, by shape only: plain attributes
        def __init__(self, **fields):
            self.__dict__.update(fields)

    want = make_token_entry(
        "foreign", "c-1", prompt=[3, 1, 4], generation=[1, 5], log_probs=[-0.5, -0.25]
    )
    await store.put(GymEntry(**want.model_dump()))

    class Dumps:  # a pydantic-like object read through model_dump()
        def model_dump(self):
            return make_token_entry("foreign", "c-2", prompt=[9], generation=[]).model_dump()

    await store.put(Dumps())
    snapshot = await store.freeze("foreign")
    assert [e.model_call_id for e in snapshot.entries] == ["c-1", "c-2"]
    got = snapshot.entries[0]
    assert got.model_dump() == want.model_dump()
    # The ids are views of the rollout's shared sequence; a dump gives plain lists.
    assert type(got.prompt_token_ids) is IdView and type(got.generation_log_probs) is list
    dumped = got.model_dump()
    assert all(type(dumped[name]) is list for name in ("prompt_token_ids", "generation_token_ids"))
    assert got.prompt_token_ids + got.generation_token_ids == [3, 1, 4, 1, 5]


def test_aliases_and_protocols(redis_url):
    assert RedisTokenSink is RedisTokenStore and RedisTokenSource is RedisTokenStore
    made = RedisTokenSink(url=redis_url)  # built outside any event loop
    assert isinstance(made, TokenSink)
    assert isinstance(made, TokenSource)
    assert isinstance(made, IntentSink)
    asyncio.run(made.close())


def test_unknown_and_missing_kwargs_are_constructor_errors(redis_url):
    with pytest.raises(TypeError, match="urll"):
        RedisTokenStore(urll=redis_url)
    with pytest.raises(TypeError):
        RedisTokenStore(redis_url)  # keyword arguments only
    with pytest.raises(ConfigError, match="exactly one of url= or client="):
        RedisTokenStore()
    with pytest.raises(ConfigError, match="durability"):
        RedisTokenStore(url=redis_url, durability="sometimes")
    with pytest.raises(ConfigError, match="'http'") as info:
        RedisTokenStore(url="http://user:secret@host")
    assert "secret" not in str(info.value)


async def test_an_existing_client_is_used_and_left_open(redis_url, redis_prefix):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    made = RedisTokenStore(client=client, key_prefix=redis_prefix)
    await made.put(make_token_entry("by-client", "c-1", prompt=list(range(300))))
    snapshot = await made.freeze("by-client")
    assert snapshot.entries[0].prompt_token_ids == list(range(300))
    await made.close()
    assert await client.ping() is True  # not ours to close
    await client.aclose()


async def test_password_in_url(redis_server_factory, redis_prefix):
    server = redis_server_factory(requirepass="s3cret-pw")
    url = server.url.replace("redis://", "redis://:s3cret-pw@")
    made = RedisTokenStore(url=url, key_prefix=redis_prefix, max_retries=0)
    await made.put(make_token_entry("authed", "c-1"))
    assert len((await made.freeze("authed")).entries) == 1
    await made.close()
    wrong = RedisTokenStore(
        url=server.url.replace("redis://", "redis://:nope@"), key_prefix=redis_prefix, max_retries=0
    )
    with pytest.raises(redis.exceptions.AuthenticationError):
        await wrong.put(make_token_entry("authed", "c-2"))
    await wrong.close()


def test_rediss_url_is_accepted_for_tls():
    made = RedisTokenStore(url="rediss://:pw@redis.example.invalid:6380/0")
    assert made._reach.chosen.mode == "fsync"
    assert made._reach.client is None  # nothing connects until first use


async def test_tombstone_expires_after_its_ttl(redis_url, redis_prefix, raw):
    made = RedisTokenStore(
        url=redis_url, key_prefix=redis_prefix, tombstone_ttl_s=30, evidence_ttl_s=3600
    )
    await made.put(make_token_entry("ttl", "c-1"))
    key = rollout_key(redis_prefix, "ttl")
    assert raw.pttl(key) == -1  # an open rollout never expires
    snapshot = await made.freeze("ttl")
    assert 30_000 < raw.pttl(key) <= 3_600_000  # frozen, not yet retired: kept as evidence
    assert await made.drop("ttl", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    assert 0 < raw.pttl(key) <= 30_000
    assert {name.decode() for name in raw.hkeys(key)} == {
        "version",
        "frozen",
        "snapshot_id",
        "incomplete",
        "retired",
        "retired_at",
    }
    await made.close()


async def test_frozen_rollouts_can_be_kept_until_deleted(redis_url, redis_prefix, raw):
    made = RedisTokenStore(url=redis_url, key_prefix=redis_prefix, evidence_ttl_s=None)
    await made.put(make_token_entry("kept", "c-1"))
    await made.freeze("kept")
    assert raw.pttl(rollout_key(redis_prefix, "kept")) == -1
    await made.delete("kept")
    assert not raw.exists(rollout_key(redis_prefix, "kept"))
    await made.close()


async def test_config_loader_builds_the_redis_sink(tmp_path, redis_url, redis_prefix, monkeypatch):
    monkeypatch.setenv("TOKCAP_REDIS_URL", redis_url)
    path = tmp_path / "gym.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        env:
          nemo_gym:
            token_id_capture:
              enabled: true
              sink: transports.redis:RedisTokenSink
              sink_kwargs: {{url: "${{oc.env:TOKCAP_REDIS_URL}}", key_prefix: {redis_prefix}}}
              rebuild_response: false
        """)
    )
    sink = load_capture_config(str(path)).build_sink()
    assert isinstance(sink, RedisTokenStore)
    await sink.put(make_token_entry("configured", "c-1"))
    source = RedisTokenSource(url=redis_url, key_prefix=redis_prefix)
    assert len((await source.freeze("configured")).entries) == 1
    await sink.close()
    await source.close()


def test_config_loader_rejects_unknown_sink_kwargs(redis_url):
    config = load_capture_config(
        {
            "token_id_capture": {
                "enabled": True,
                "sink": "transports.redis:RedisTokenSink",
                "sink_kwargs": {"url": redis_url, "prefix": "typo"},
            }
        }
    )
    with pytest.raises(ConfigError, match="prefix"):
        config.build_sink()


def _rollout(rollout_id: str, turns: int) -> list:
    from tests.support.rollouts import growing_rollout

    return growing_rollout(
        rollout_id, turns, system_tokens=600, generated_per_turn=50, tool_tokens_per_turn=80
    )


async def test_branching_prompts_round_trip_exactly(redis_url, redis_prefix):
    """Retries, forks and prefixes of each other, from two writers with their own caches."""
    import random

    rng = random.Random(7)
    writers = [RedisTokenStore(url=redis_url, key_prefix=redis_prefix) for _ in range(2)]
    sequences = [[rng.randrange(151_000) for _ in range(rng.randrange(1, 700))]]
    entries = []
    for number in range(60):
        base = rng.choice(sequences)
        cut = rng.randrange(len(base) + 1)  # a fork anywhere, a prefix, or a full extension
        prompt = base[:cut] + [rng.randrange(151_000) for _ in range(rng.choice([0, 1, 7, 260]))]
        generation = [rng.randrange(151_000) for _ in range(rng.randrange(0, 40))]
        entry = make_token_entry(
            "branchy",
            f"c-{number:03d}",
            prompt=prompt,
            generation=generation,
            log_probs=[-rng.random() for _ in generation],
        )
        await writers[number % 2].put(entry)
        entries.append(entry)
        sequences.append(prompt + generation)
    snapshot = await writers[0].freeze("branchy")
    assert [e.model_dump() for e in snapshot.entries] == [e.model_dump() for e in entries]
    for writer in writers:
        await writer.close()


async def test_a_long_rollout_new_to_this_writer_sends_only_what_is_missing(
    redis_server_factory, redis_prefix
):
    """Another front end wrote the history: the put asks by name, then sends the new block."""
    server = redis_server_factory()
    first = RedisTokenStore(url=server.url, key_prefix=redis_prefix)
    second = RedisTokenStore(url=server.url, key_prefix=redis_prefix)
    history = list(range(20_000))  # 80 kB of packed ids
    await first.put(make_token_entry("hop", "c-1", prompt=history, generation=[1]))
    await second.check()
    with redis.Redis.from_url(server.url) as raw:
        before = raw.info("stats")["total_net_input_bytes"]
        await second.put(make_token_entry("hop", "c-2", prompt=[*history, 1, 5], generation=[2]))
        after = raw.info("stats")["total_net_input_bytes"]
    assert after - before < 16_000  # names of 81 blocks twice, and one block's bytes
    # And back: the first writer's memory of the tail is stale, and it still stores right.
    third = make_token_entry("hop", "c-3", prompt=[*history, 1, 5, 2, 9], generation=[3])
    await first.put(third)
    snapshot = await first.freeze("hop")
    assert [e.prompt_token_ids for e in snapshot.entries] == [
        history,
        [*history, 1, 5],
        [*history, 1, 5, 2, 9],
    ]
    await first.close()
    await second.close()


async def test_a_flushed_script_cache_is_loaded_again(store, raw, redis_prefix):
    await store.put(make_token_entry("flushed", "c-1"))
    raw.script_flush()
    await store.put(make_token_entry("flushed", "c-2"))
    assert len((await store.freeze("flushed")).entries) == 2


async def test_a_payload_stored_at_another_block_size_teaches_no_block_names(
    redis_url, redis_prefix
):
    """Writers of one rollout may cut blocks at different sizes. A put answered "same" (the
    payload was stored by the other writer) must not count its own blocks as held, or the
    next put would leave them out and the rollout would not decode."""
    calls = growing_rollout("mixed", 3, system_tokens=600, generated_per_turn=40)
    first = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    second = RedisTokenStore(url=redis_url, key_prefix=redis_prefix, block_size=64)
    try:
        await first.put(calls[0])
        await second.put(calls[0])  # the same payload: "same"
        await second.put(calls[1])
        await first.put(calls[2])
        snapshot = await first.freeze("mixed")
        assert not snapshot.incomplete
        assert [entry.model_dump() for entry in snapshot.entries] == [
            call.model_dump() for call in calls
        ]
    finally:
        await first.close()
        await second.close()


async def test_routes_come_back_from_redis_as_each_call_was_served(store, redis_prefix) -> None:
    """Routed experts ride in blocks beside the ids, by name or with their bytes; a call
    re-put with other routes is another payload and marks the rollout incomplete."""
    entries = rollout(12, per_turn=300, rollout_id="routes")  # long: blocks by name first
    for entry in entries:
        await store.put(entry)
    again = entries[3].model_copy(
        update={"routed_experts": Routes.from_array(entries[3].routed_experts.to_numpy() + 1)}
    )
    await store.put(entries[3])  # the same payload: a no-op
    with pytest.raises(Exception, match="different payload|conflict"):
        await store.put(again)
    snapshot = await store.freeze("routes")
    got = {entry.model_call_id: entry.routed_experts for entry in snapshot.entries}
    assert got == {entry.model_call_id: entry.routed_experts for entry in entries}
    assert snapshot.incomplete


async def test_the_policy_version_is_one_per_prefix_and_survives_a_new_client(
    store, redis_url, redis_prefix
) -> None:
    assert await store.policy_version() is None
    await store.set_policy_version("12")
    other = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    try:
        assert await other.policy_version() == "12"
        await other.set_policy_version("13")
    finally:
        await other.close()
    assert await store.policy_version() == "13"
    elsewhere = RedisTokenStore(url=redis_url, key_prefix=redis_prefix + "-other")
    try:
        assert await elsewhere.policy_version() is None
    finally:
        await elsewhere.close()


async def test_intents_ready_at_once_are_scripts_sharing_round_trips(store, raw, redis_prefix):
    """An intent is one script, never a WATCH transaction, and intents ready at once go out
    together; each decides as before: a void with nothing pending, or an intent already
    open, writes nothing (the version stays), a frozen rollout refuses a new one."""
    await store.check()
    raw.config_resetstat()
    rollouts = [f"intent-{n}" for n in range(40)]
    await asyncio.gather(*(store.begin_call(r, "c-1") for r in rollouts))
    stats = raw.info("commandstats")
    assert "cmdstat_watch" not in stats and "cmdstat_multi" not in stats
    assert stats["cmdstat_evalsha"]["calls"] == 40  # each once (a first one may be loaded)
    # Batched: a connection or two for all 40, where transactions took one each.
    assert stats.get("cmdstat_hello", {"calls": 0})["calls"] <= 2
    key = rollout_key(redis_prefix, "intent-0")
    assert raw.hget(key, "i:c-1") == b"open" and raw.hget(key, "version") == b"1"
    await store.begin_call("intent-0", "c-1")  # already open
    await store.void_call("intent-0", "c-9")  # nothing pending
    assert raw.hget(key, "version") == b"1" and raw.hget(key, "i:c-9") is None
    await store.void_call("intent-0", "c-1")
    assert raw.hget(key, "i:c-1") == b"void" and raw.hget(key, "version") == b"2"
    snapshot = await store.freeze("intent-1")
    assert snapshot.incomplete  # its intent is pending
    with pytest.raises(RolloutFrozenError):
        await store.begin_call("intent-1", "c-2")
    await store.void_call("intent-1", "c-2")  # nothing pending: a no-op, frozen or not
    assert (await store.freeze("intent-1")).version == snapshot.version
