"""The Redis names are a wire format: workers, trainers and operators of other versions read
them, so they are pinned here as literal text."""

from __future__ import annotations

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
