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
from transports.redis.keys import as_text


class QueueLayoutError(ConfigError):
    """This process was given another shard layout than the queue already has."""


def layout_key(stream: str) -> str:
    """Where a queue's layout is kept: beside its base stream's name."""
    return f"{stream}.layout"


def layout_value(shards: int, cluster: bool) -> str:
    return f"{shards} {'cluster' if cluster else 'single'}"


def _words(value: str) -> str:
    shards, _, kind = value.partition(" ")
    plural = "" if shards == "1" else "s"
    return f"{shards} shard{plural}" + (" with cluster names" if kind == "cluster" else "")


async def agree_on_layout(client: Any, stream: str, shards: int, cluster: bool, who: str) -> None:
    """Record this layout for the queue of ``stream`` unless one is there; refuse another."""
    key, want = layout_key(stream), layout_value(shards, cluster)
    await client.set(key, want, nx=True)
    have = as_text(await client.get(key) or b"")
    if have and have != want:
        raise QueueLayoutError(
            f"the queue {stream} has {_words(have)}, but this {who} was given {_words(want)}: "
            "give every submitter, worker and trainer of a queue the same --shards and "
            f"--cluster (to change the layout, drain the queue and delete {key})"
        )
