"""The trainer's reader of the results stream, on one Redis or a Redis Cluster, for one
shard or many.

A worker publishes each result on its rollout's shard (``transports.redis.keys.shard_of``;
one shard unless the queue was built with more), so a trainer reads every shard, one
``ShardReader`` per shard stream in the same consumer group under the same consumer name.
Like the worker's job reads (``transports.rebuild.shards``), a read looks at each shard in
turn, briefly, starting one further each time, and waits on one shard only when all were
empty. A record is acknowledged on the shard it came from: its rollout's.

Each shard is read as a consumer group reads a stream: first this consumer's own
unacknowledged records (a restarted trainer with the same consumer name gets them back),
then, with ``claim_idle_ms``, records another consumer left unacknowledged for that long,
then new ones. An acknowledged record is deleted from the stream (each holds a whole final
context), unless ``delete_acked`` is False because other consumer groups read it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from capture.rollout_ids import rollout_id_from_run_body
from transports.rebuild.layout import agree_on_layout
from transports.rebuild.results import RESULT_ID_KEY, decode_result, ensure_group, result_id_of
from transports.redis.clients import RedisOptions, open_client
from transports.redis.eviction import check_client_eviction
from transports.redis.keys import as_text, consumer_name, shard_names, shard_of, stream_names

# How long a look at one shard waits while others remain to be looked at (1 ms is the
# least XREADGROUP takes: BLOCK 0 would wait for ever).
GLANCE_MS = 1


class ShardReader:
    """One shard's stream, read in the trainer's consumer group (see the module doc)."""

    def __init__(
        self,
        client: Any,
        stream: str,
        group: str,
        consumer: str,
        claim_idle_ms: int | None,
        delete_acked: bool,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.delete_acked = delete_acked
        self._group_ready = False
        self._pending_cursor: str | None = "0"  # None once own pending records are re-read
        self._outstanding: set[str] = set()  # handed out here, not yet acknowledged
        self._claim_cursor = "0-0"  # XAUTOCLAIM scans the pending list in rounds

    async def read(self, count: int, block: int) -> list[dict[str, Any]]:
        """Up to ``count`` records (own pending first, then claimed, then new); [] on timeout."""
        if not self._group_ready:
            await ensure_group(self.client, self.stream, self.group)
            self._group_ready = True
        if self._pending_cursor is not None:
            entries = await self._read_group(self._pending_cursor, count, None)
            if entries:
                self._pending_cursor = as_text(entries[-1][0])
                return self._hand_out(entries)
            self._pending_cursor = None
        if self.claim_idle_ms is not None:
            claimed = await self.client.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                self.claim_idle_ms,
                start_id=self._claim_cursor,
                count=count,
            )
            self._claim_cursor = as_text(claimed[0])
            records = self._hand_out(claimed[1])
            if records:
                return records
        return self._hand_out(await self._read_group(">", count, block))

    def _hand_out(self, entries: list[Any]) -> list[dict[str, Any]]:
        # Deleted entries come back without fields; a record still outstanding here was
        # only re-claimed because the trainer is slow to ack, so it is not handed out twice.
        records = []
        for entry_id, fields in entries:
            entry_id = as_text(entry_id)
            if fields is None or entry_id in self._outstanding:
                continue
            self._outstanding.add(entry_id)
            records.append(decode_result(entry_id, fields))
        return records

    async def _read_group(self, start: str, count: int, block: int | None) -> list[Any]:
        reply = await self.client.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=count, block=block
        )
        return list(reply[0][1]) if reply else []

    async def ack(self, result_id: str) -> bool:
        self._outstanding.discard(result_id)
        if not self.delete_acked:
            return bool(await self.client.xack(self.stream, self.group, result_id))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, result_id)
            pipe.xdel(self.stream, result_id)
            acked, _ = await pipe.execute()
        return bool(acked)


class ResultsReader:
    """Async iterator over rebuilt records; ``ack`` each once the trainer's handoff is durable.

    ``url`` or ``client``; ``stream`` is the results stream (with ``shards`` > 1 or on a
    cluster, the base of the shards' names); ``shards`` and ``cluster`` must be the workers'.
    ``read`` returns up to ``count`` records, waiting up to ``block_ms`` (on a client of its
    own, at most the reader's ``block_ms``: that client's socket timeout is sized for it).
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
            raise ValueError("ResultsReader needs exactly one of url= or client=")
        cluster = cluster or isinstance(client, RedisCluster)
        self._owns_client = client is None
        options = RedisOptions(url=url, cluster=cluster)
        self.client = client if client is not None else open_client(options, block_ms)
        self.block_ms = block_ms
        self.count = count
        consumer = consumer or consumer_name()
        self.shards = [
            ShardReader(self.client, name, group, consumer, claim_idle_ms, delete_acked)
            for name in shard_names(stream, shards, tagged=cluster)
        ]
        self._turn = 0
        self._layout = (stream, shards, cluster)
        self._layout_agreed = False
        self._from: dict[str, ShardReader] = {}  # result id -> the shard that handed it out
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
        block = min(block, self.block_ms) if self._owns_client else block
        start = self._turn % len(self.shards)
        self._turn += 1
        order = self.shards[start:] + self.shards[:start]
        for position, shard in enumerate(order):
            last = position == len(order) - 1
            wait = max(1, block // len(order)) if last else GLANCE_MS
            records = await shard.read(count, wait)
            if records:
                for record in records:
                    self._from[as_text(record[RESULT_ID_KEY])] = shard
                return records
        return []

    async def ack(self, record_or_id: Mapping[str, Any] | str | bytes) -> bool:
        """Acknowledge one record (or its result id) on the shard it came from: it will not
        be delivered again."""
        result_id = result_id_of(record_or_id)
        shard = None
        if isinstance(record_or_id, Mapping):
            rollout_id = rollout_id_from_run_body(record_or_id)
            if rollout_id is not None:
                shard = self.shards[shard_of(rollout_id, len(self.shards))]
        handed = self._from.pop(result_id, None)
        shard = shard or handed
        if shard is None:
            if len(self.shards) > 1:
                raise ValueError(f"result {result_id} was not read here: pass the record")
            shard = self.shards[0]
        return await shard.ack(result_id)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._buffer:
            self._buffer = await self.read()
        return self._buffer.pop(0)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
            self._owns_client = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
