"""Every Redis key and stream name tokcap uses, and how a rollout is laid out in its hash.

Everything lives under one key prefix (``tokcap`` unless configured): the rollout hashes
``<prefix>:{<rollout_id>}``, the jobs stream ``<prefix>:rebuild`` with its dead letters and
its error notes, and the results stream ``<prefix>:results`` with the worker's publish
guards. The braces of a rollout key make Redis Cluster hash only the rollout id, so every
key of one rollout (today there is one) lives in one slot and one WATCH/MULTI covers it.
Inside the hash, state fields have fixed names and everything per call or per block carries
a one-letter kind prefix, so a field name alone says what it holds.
"""

from __future__ import annotations

import os
import re
import socket
from functools import lru_cache
from typing import Any, NamedTuple

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

DEFAULT_PREFIX = "tokcap"

# -- a rollout's hash -------------------------------------------------------------------

# State fields: these survive a drop and form the tombstone.
VERSION = "version"
FROZEN = "frozen"
SNAPSHOT_ID = "snapshot_id"
INCOMPLETE = "incomplete"
RETIRED = "retired"
RETIRED_AT = "retired_at"
STATE_FIELDS = (VERSION, FROZEN, SNAPSHOT_ID, INCOMPLETE, RETIRED, RETIRED_AT)
# Random, set by the first put and gone when the hash is: a writer's cache of the block
# names a hash holds is valid only while the epoch it saw is still there.
EPOCH = "epoch"

# Per-call and per-block fields, by kind.
ENTRY = "e:"  # e:<model_call_id> -> the codec body
DIGEST = "d:"  # d:<model_call_id> -> payload digest (idempotency check)
INTENT = "i:"  # i:<model_call_id> -> OPEN or VOID
MARK = "m:"  # m:<model_call_id> -> why the call was lost ("" call id: the rollout as a whole)
UNRECEIVED = "u:"  # u:<model_call_id> -> 1: the harness never received this call's reply
BLOCK = "b:"  # b:<block name> -> a stored block of the codec (see capture.codec.blocks)
TAIL = "t:"  # t:<parent block name> -> the codec tail: the partial block a later call may extend

INTENT_OPEN = b"open"
INTENT_VOID = b"void"

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def policy_version_key(prefix: str) -> str:
    """The policy version the trainer set: every front end stamps new calls with it."""
    return f"{prefix}:policy_version"


def rollout_key(prefix: str, rollout_id: str) -> str:
    return f"{prefix}:{{{rollout_id}}}"


def rollout_pattern(prefix: str) -> str:
    """A SCAN pattern matching every rollout hash under ``prefix``."""
    return _GLOB_SPECIAL.sub(r"\\\1", prefix) + ":{*}"


def rollout_id_of(prefix: str, key: str) -> str | None:
    """The rollout id a key names, or None if the key is not a rollout hash of ``prefix``."""
    head = prefix + ":{"
    if key.startswith(head) and key.endswith("}"):
        return key[len(head) : -1]
    return None


def field(kind: str, name: str) -> str:
    return kind + name


def split_field(name: bytes) -> tuple[str, str]:
    """``b"e:call-1"`` -> ``("e:", "call-1")``; a state field -> ``("", name)``."""
    text = name.decode()
    if len(text) > 1 and text[1] == ":":
        return text[:2], text[2:]
    return "", text


# -- the streams, and the keys the rebuild worker keeps beside them ----------------------


class Streams(NamedTuple):
    """The streams of one key prefix."""

    jobs: str  # rebuild jobs, read by the worker pool's consumer group
    results: str  # rebuilt records, read by the trainer
    dead: str  # jobs that can never succeed, with their error


def stream_names(key_prefix: str = DEFAULT_PREFIX) -> Streams:
    """(jobs, results, dead-letter) stream names for one key prefix."""
    return Streams(f"{key_prefix}:rebuild", f"{key_prefix}:results", f"{key_prefix}:rebuild:dead")


MAX_SHARDS = 1024


def shard_streams(base: Streams, shards: int = 1, *, tagged: bool = False) -> list[Streams]:
    """The streams of each of ``shards`` shards, named after ``base``.

    One untagged shard is ``base`` itself, the names single-node Redis has always used.
    Otherwise shard ``i`` appends the hash tag ``{<tag i>}`` to each name, so its jobs, its
    dead letters, its results and the worker's guards beside them share one Cluster slot
    (the worker's transactions and its publish script span them), while the tags of
    different shards fall in evenly spaced slots, so shards spread over the masters.
    Every producer and consumer of one queue must be given the same number of shards.
    """
    columns = [shard_names(name, shards, tagged=tagged) for name in base]
    return [Streams(*names) for names in zip(*columns, strict=True)]


def shard_names(base: str, shards: int = 1, *, tagged: bool = False) -> list[str]:
    """One stream name per shard (see ``shard_streams``): ``base``, or ``base:{<tag>}``."""
    if not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be an integer within 1..{MAX_SHARDS}, got {shards!r}")
    if shards == 1 and not tagged:
        return [base]
    if "{" in base or "}" in base:
        raise ValueError(f"a sharded stream name must not hold braces (a hash tag): {base!r}")
    return [f"{base}:{{{tag}}}" for tag in shard_tags(shards)]


@lru_cache(maxsize=16)
def shard_tags(shards: int) -> tuple[str, ...]:
    """One hash tag per shard, shard ``i``'s in the ``i``-th of ``shards`` equal slot ranges.

    ``redis-cli --cluster create`` gives each master one contiguous range, so with as many
    shards as masters each master holds one; with more, they spread evenly.
    """
    tags = []
    for index in range(shards):
        wanted = range(
            index * REDIS_CLUSTER_HASH_SLOTS // shards,
            (index + 1) * REDIS_CLUSTER_HASH_SLOTS // shards,
        )
        number = 0
        while key_slot(f"s{index}.{number}".encode()) not in wanted:
            number += 1
        tags.append(f"s{index}.{number}")
    return tuple(tags)


def shard_of(rollout_id: str, shards: int) -> int:
    """The shard of a rollout's job and result: the slice of slots its hash lives in.

    A function of the rollout id alone, so every submitter, every worker and every re-run
    agree; with one shard per master, a rollout's job sits on the master of its hash.
    """
    return key_slot(rollout_id.encode()) * shards // REDIS_CLUSTER_HASH_SLOTS


def layout_key(stream: str) -> str:
    """Where a queue's layout (its shard count and cluster tagging) is kept: beside its base
    stream's name (``transports.rebuild.layout``)."""
    return f"{stream}.layout"


def consumer_name() -> str:
    """This process's default name in a consumer group: its host and PID, unique while it
    lives, so two workers or readers never share pending entries by accident."""
    return f"{socket.gethostname()}-{os.getpid()}"


def job_errors_key(jobs_stream: str) -> str:
    """A hash: job id -> the last error of a job that is still pending."""
    return f"{jobs_stream}:errors"


def publish_guard_key(
    results_stream: str, rollout_id: str, snapshot_id: str, version: int, job_id: str = ""
) -> str:
    """The worker's note that one snapshot version was published: ``<result id> <ok flag>``.

    A build without a snapshot (it failed before freeze) is named by its job instead.
    """
    name = f"{snapshot_id}:{version}" if snapshot_id else f"job:{job_id}"
    return f"{results_stream}:published:{rollout_id}:{name}"


def latest_result_key(results_stream: str, rollout_id: str) -> str:
    """The rollout's latest published result: ``<result id> <snapshot id> <version>``."""
    return f"{results_stream}:latest:{rollout_id}"


def as_text(value: Any) -> str:
    """A reply or stream field as text (redis-py hands back bytes unless told to decode)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
