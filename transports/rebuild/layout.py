"""A queue's shard layout, agreed in Redis by everyone who opens the queue.

A submitter, the workers and the trainer of one queue must use the same shards (and the
same choice of cluster naming), or jobs and results land on streams nobody reads: a stall
that looks like a slow queue. The first to open a queue writes its layout beside the
streams (``SET NX`` on ``<stream>.layout``, outside the names a worker keeps under
``<stream>:``); everyone else compares and refuses another, naming both and the fix.
"""

from __future__ import annotations

from typing import Any

from capture.errors import ConfigError
from transports.redis.keys import as_text, layout_key


class QueueLayoutError(ConfigError):
    """This process was given another shard layout than the queue already has."""


def layout_value(shards: int, cluster: bool) -> str:
    return f"{shards} {'cluster' if cluster else 'single'}"


def _words(value: str) -> str:
    shards, _, kind = value.partition(" ")
    plural = "" if shards == "1" else "s"
    return f"{shards} shard{plural}" + (" with cluster names" if kind == "cluster" else "")


def mismatch(stream: str, have: Any, shards: int, cluster: bool, who: str) -> str | None:
    """Why a process given this layout must not use the queue recorded as ``have``."""
    have, want = as_text(have or b""), layout_value(shards, cluster)
    if not have or have == want:
        return None
    return (
        f"the queue {stream} has {_words(have)}, but this {who} was given {_words(want)}: "
        "give every submitter, worker and trainer of a queue the same --shards and "
        f"--cluster (to change the layout, drain the queue and delete {layout_key(stream)})"
    )


async def agree_on_layout(client: Any, stream: str, shards: int, cluster: bool, who: str) -> None:
    """Record this layout for the queue of ``stream`` unless one is there; refuse another."""
    key = layout_key(stream)
    await client.set(key, layout_value(shards, cluster), nx=True)
    problem = mismatch(stream, await client.get(key), shards, cluster, who)
    if problem is not None:
        raise QueueLayoutError(problem)
