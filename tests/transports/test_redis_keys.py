"""The Redis names are a wire format: workers, trainers and operators of other versions read
them, so they are pinned here as literal text."""

from __future__ import annotations

import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from transports.redis import keys as k


def test_stream_names_of_a_prefix() -> None:
    assert k.stream_names() == ("tokcap:rebuild", "tokcap:results", "tokcap:rebuild:dead")
    streams = k.stream_names("p")
    assert (streams.jobs, streams.results, streams.dead) == (
        "p:rebuild",
        "p:results",
        "p:rebuild:dead",
    )


def test_the_worker_keys_beside_the_streams() -> None:
    assert k.job_errors_key("p:rebuild") == "p:rebuild:errors"
    assert k.publish_guard_key("p:results", "r-1", "abc", 3) == "p:results:published:r-1:abc:3"
    # A build that failed before freeze has no snapshot: its job names the guard.
    assert (
        k.publish_guard_key("p:results", "r-1", "", 0, "5-1") == "p:results:published:r-1:job:5-1"
    )
    assert k.latest_result_key("p:results", "r-1") == "p:results:latest:r-1"


def test_a_rollout_hash_is_named_with_a_cluster_hash_tag() -> None:
    assert k.rollout_key("tokcap", "r-1") == "tokcap:{r-1}"
    assert k.rollout_id_of("tokcap", "tokcap:{r-1}") == "r-1"
    assert k.rollout_id_of("tokcap", "other:{r-1}") is None


def test_one_untagged_shard_keeps_the_single_node_names() -> None:
    base = k.stream_names("p")
    assert k.shard_streams(base) == [base]
    assert k.shard_names("p:rebuild") == ["p:rebuild"]


def test_shards_are_hash_tagged_and_spread_evenly_over_the_slots() -> None:
    shards = k.shard_streams(k.stream_names("p"), 3)
    assert shards[0] == ("p:rebuild:{s0.0}", "p:results:{s0.0}", "p:rebuild:dead:{s0.0}")
    for index, streams in enumerate(shards):
        # A shard's streams, errors and guards share one slot, in the index-th third.
        names = [*streams, k.job_errors_key(streams.jobs)]
        names.append(k.publish_guard_key(streams.results, "r-1", "snap", 2))
        slots = {key_slot(name.encode()) for name in names}
        assert len(slots) == 1
        slot = slots.pop()
        assert (
            index * REDIS_CLUSTER_HASH_SLOTS // 3
            <= slot
            < (index + 1) * REDIS_CLUSTER_HASH_SLOTS // 3
        )
    # On a cluster even one shard is tagged: its multi-key steps must stay in one slot.
    (one,) = k.shard_streams(k.stream_names("p"), 1, tagged=True)
    assert len({key_slot(name.encode()) for name in one}) == 1


def test_a_rollout_has_one_shard_in_range() -> None:
    assert k.shard_of("r-1", 1) == 0
    seen = {k.shard_of(f"r-{n}", 3) for n in range(200)}
    assert seen == {0, 1, 2}
    assert k.shard_of("r-7", 3) == k.shard_of("r-7", 3)


def test_shard_counts_and_names_that_cannot_work_are_refused() -> None:
    for bad in (0, -1, k.MAX_SHARDS + 1, 2.5, "3"):
        with pytest.raises(ValueError, match="shards must be"):
            k.shard_names("p:rebuild", bad)
    with pytest.raises(ValueError, match="braces"):
        k.shard_names("{p}:rebuild", 2)
