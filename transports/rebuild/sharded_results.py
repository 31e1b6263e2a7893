"""The trainer's reader of a sharded results stream, on one Redis or a Redis Cluster.

A worker publishes each result on its rollout's shard (``transports.redis.keys.shard_of``),
so a trainer reads every shard, one ``ResultsReader`` per shard stream in the same consumer
group under the same consumer name. Like the worker's job reads
(``transports.rebuild.shards``), a read looks at each shard in turn, briefly, starting one
further each time, and waits on one shard only when all were empty. A record is
acknowledged on the shard it came from: its rollout's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from capture.rollout_ids import rollout_id_from_run_body
from transports.rebuild.layout import agree_on_layout
from transports.rebuild.results import (
    RESULT_ID_KEY,
    BufferedReader,
    ResultsReader,
    result_id_of,
)
from transports.redis.clients import RedisOptions, open_client
from transports.redis.eviction import check_client_eviction
from transports.redis.keys import as_text, consumer_name, shard_names, shard_of, stream_names

# How long a look at one shard waits while others remain to be looked at (1 ms is the
# least XREADGROUP takes: BLOCK 0 would wait for ever).
GLANCE_MS = 1


class ShardedResultsReader(BufferedReader):
    """``ResultsReader`` over all shards: ``read``, ``ack``, async iteration, ``close``.

    ``stream`` is the base of the shards' names; ``shards`` and ``cluster`` must be the
    workers'. The other arguments are ``ResultsReader``'s, for every shard.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        client: aioredis.Redis | RedisCluster | None = None,
        stream: str = stream_names().results,
        shards: int = 1,
        cluster: bool = False,
        group: str = "trainer",
        consumer: str | None = None,
        block_ms: int = 1000,
        count: int = 16,
        claim_idle_ms: int | None = 60_000,
        delete_acked: bool = True,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("ShardedResultsReader needs exactly one of url= or client=")
        cluster = cluster or isinstance(client, RedisCluster)
        self.streams = shard_names(stream, shards, tagged=cluster)
        self._owns_client = client is None
        options = RedisOptions(url=url, cluster=cluster)
        self.client = client if client is not None else open_client(options, block_ms)
        consumer = consumer or consumer_name()
        self.readers = [
            ResultsReader(
                client=self.client,
                stream=name,
                group=group,
                consumer=consumer,
                block_ms=block_ms,
                count=count,
                claim_idle_ms=claim_idle_ms,
                delete_acked=delete_acked,
                check_layout=False,  # the queue's layout is this reader's to check
            )
            for name in self.streams
        ]
        self.block_ms = block_ms
        self.count = count
        self._turn = 0
        self._layout = (stream, shards, cluster)
        self._layout_agreed = False
        self._from: dict[str, ResultsReader] = {}  # result id -> the shard that handed it out
        self._buffer: list[dict[str, Any]] = []

    async def read(
        self, count: int | None = None, block_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """Up to ``count`` records from the shards; [] when all stayed empty."""
        count = count or self.count
        if not self._layout_agreed:
            await check_client_eviction(self.client)
            await agree_on_layout(self.client, *self._layout, "results reader")
            self._layout_agreed = True
        block = self.block_ms if block_ms is None else block_ms
        block = min(block, self.block_ms) if self._owns_client else block  # see ResultsReader
        start = self._turn % len(self.readers)
        self._turn += 1
        order = self.readers[start:] + self.readers[:start]
        for position, reader in enumerate(order):
            last = position == len(order) - 1
            wait = max(1, block // len(order)) if last else GLANCE_MS
            records = await reader.read(count, wait)
            if records:
                for record in records:
                    self._from[as_text(record[RESULT_ID_KEY])] = reader
                return records
        return []

    async def ack(self, record_or_id: Mapping[str, Any] | str | bytes) -> bool:
        """Acknowledge one record (or its result id) on the shard it came from."""
        result_id = result_id_of(record_or_id)
        reader = None
        if isinstance(record_or_id, Mapping):
            rollout_id = rollout_id_from_run_body(record_or_id)
            if rollout_id is not None:
                reader = self.readers[shard_of(rollout_id, len(self.readers))]
        handed = self._from.pop(result_id, None)
        reader = reader or handed
        if reader is None:
            if len(self.readers) > 1:
                raise ValueError(f"result {result_id} was not read here: pass the record")
            reader = self.readers[0]
        return await reader.ack(result_id)
