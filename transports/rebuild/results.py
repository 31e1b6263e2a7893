"""The results stream: rebuilt records on their way to the trainer.

The worker publishes each rebuilt record once per (rollout, snapshot id, version). The trainer
reads them in its own consumer group with ``ResultsReader`` and acknowledges a record only
when its own handoff is durable; an unacknowledged record is delivered again (to the same
consumer after a restart, or to another one after ``claim_idle_ms``).

A result can supersede an earlier one of the same rollout: when a late loss mark changed the
snapshot after its result was published, the worker publishes the rebuilt record with a
``supersedes`` field naming the earlier result id, and ``decode_result`` puts it on the record
as ``_ng_supersedes``. The newer result is authoritative (see the README's trainer section).

On the wire a token-bearing item whose ``prompt_token_ids`` extends the previous item's
prompt + generation stores only the new tail, so a result grows with the final context,
not with turns x context. ``decode_result`` restores the exact arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from capture.codec.views import IdView, json_default, shares_prefix
from transports.rebuild.layout import agree_on_layout
from transports.redis.clients import RedisOptions, open_client
from transports.redis.eviction import check_client_eviction
from transports.redis.keys import as_text, consumer_name, stream_names

RESULT_ID_KEY = "_ng_result_id"
SUPERSEDES_KEY = "_ng_supersedes"  # on a decoded record: the result id this one replaces
SUPERSEDES_FIELD = "supersedes"  # the same, as a stream field beside the record
_PREFIX_MARK = "_tokcap_prompt_prefix"


def _output_items(record: Mapping[str, Any]) -> list[Any] | None:
    response = record.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    return output if isinstance(output, list) else None


def compact_record(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of the record whose prompts store only what extends the previous item.

    Views of one chain's sequence (``capture.codec.views``) are proven to extend the
    previous item by identity; lists are compared. Either way no prompt is copied whole.
    """
    items = _output_items(record)
    if not items:
        return record
    compacted = []
    previous: tuple[Sequence[int], Sequence[int]] | None = None
    for item in items:
        prompt = item.get("prompt_token_ids") if isinstance(item, dict) else None
        if not isinstance(prompt, (list, IdView)):
            compacted.append(item)
            continue
        out = item
        shared = _shared_prefix(prompt, previous)
        if shared:
            out = {**item, _PREFIX_MARK: shared, "prompt_token_ids": prompt[shared:]}
        compacted.append(out)
        generation = item.get("generation_token_ids")
        previous = (prompt, generation if isinstance(generation, (list, IdView)) else [])
    return {**record, "response": {**record["response"], "output": compacted}}


def _shared_prefix(
    prompt: Sequence[int], previous: tuple[Sequence[int], Sequence[int]] | None
) -> int:
    """How many leading ids of ``prompt`` are the previous item's prompt + generation
    (all of them, or 0 when it does not start with them)."""
    if previous is None:
        return 0
    before, generation = previous
    size = len(before) + len(generation)
    if not size or len(prompt) < size:
        return 0
    if shares_prefix(prompt, before, generation):
        return size
    start = len(before)
    if prompt[start:size] == generation and prompt[:start] == before:
        return size
    return 0


def expand_record(record: dict[str, Any]) -> dict[str, Any]:
    """Undo ``compact_record`` in place; the arrays come back exactly.

    An item that extends the previous one gets views of one shared sequence (as a rebuild
    in process does), so the expanded record also grows with the final context.
    """
    items = _output_items(record)
    if not items:
        return record
    sequence: list[int] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("prompt_token_ids"), list):
            continue
        shared = item.pop(_PREFIX_MARK, None)
        if shared is None:
            sequence = list(item["prompt_token_ids"])
        elif shared != len(sequence):
            raise ValueError(f"result item extends {shared} tokens, but {len(sequence)} precede it")
        else:
            sequence.extend(item["prompt_token_ids"])
        prompt_len = len(sequence)
        item["prompt_token_ids"] = IdView(sequence, 0, prompt_len)
        generation = item.get("generation_token_ids")
        if isinstance(generation, list):
            sequence.extend(generation)
            item["generation_token_ids"] = IdView(sequence, prompt_len, len(sequence))
    return record


def encode_result(record: dict[str, Any], **meta: Any) -> dict[str, Any]:
    """Stream fields of one result: plain metadata beside the msgpack record."""
    fields = {
        key: ("1" if value is True else "0" if value is False else str(value))
        for key, value in meta.items()
    }
    fields["format"] = "msgpack"
    fields["record"] = msgpack.packb(
        compact_record(record), use_bin_type=True, default=json_default
    )
    return fields


def decode_result(result_id: Any, fields: Mapping[Any, Any]) -> dict[str, Any]:
    """The rebuilt record of one stream entry, with its stream id under ``_ng_result_id``.

    A result that supersedes an earlier one also carries that id under ``_ng_supersedes``;
    one the record brought along from elsewhere is removed, so the key always means this
    stream entry's link.
    """
    fields = {as_text(key): value for key, value in fields.items()}
    record = msgpack.unpackb(fields["record"], raw=False, strict_map_key=False)
    record = expand_record(record)
    record[RESULT_ID_KEY] = as_text(result_id)
    supersedes = as_text(fields.get(SUPERSEDES_FIELD) or "")
    if supersedes:
        record[SUPERSEDES_KEY] = supersedes
    else:
        record.pop(SUPERSEDES_KEY, None)
    return record


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) unless it exists; safe to race."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def result_id_of(record_or_id: Mapping[str, Any] | str | bytes) -> str:
    """The result id of a record a reader handed out, or the id itself."""
    if isinstance(record_or_id, Mapping):
        result_id = record_or_id.get(RESULT_ID_KEY)
        if result_id is None:
            raise ValueError(f"record has no {RESULT_ID_KEY}; was it read by a ResultsReader?")
        return as_text(result_id)
    return as_text(record_or_id)


class BufferedReader:
    """What every results reader shares: async iteration over ``read`` batches, and closing
    the client it opened itself (``_owns_client``) as an async context manager."""

    client: Any
    _owns_client: bool
    _buffer: list[dict[str, Any]]

    async def read(self) -> list[dict[str, Any]]:
        raise NotImplementedError

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


class ResultsReader(BufferedReader):
    """Async iterator over rebuilt records; ``ack`` each once the trainer's handoff is durable.

    It first re-reads this consumer's own unacknowledged records (a restarted trainer with the
    same consumer name gets them back), then new ones; with ``claim_idle_ms`` it also takes
    over records another consumer left unacknowledged for that long. An acknowledged record is
    deleted from the stream (each holds a whole final context), unless ``delete_acked`` is
    False because other consumer groups read the same stream.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        client: aioredis.Redis | None = None,
        stream: str = stream_names().results,
        group: str = "trainer",
        consumer: str | None = None,
        block_ms: int = 1000,
        count: int = 16,
        claim_idle_ms: int | None = 60_000,
        delete_acked: bool = True,
        check_layout: bool = True,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("ResultsReader needs exactly one of url= or client=")
        # A stream of its own is a queue of one shard (``transports.rebuild.layout``); a
        # shard of a sharded reader is checked by that reader, as its whole queue.
        self._check_layout = check_layout
        self.delete_acked = delete_acked
        self._owns_client = client is None
        options = RedisOptions(url=url)
        self.client = client if client is not None else open_client(options, block_ms)
        self.stream = stream
        self.group = group
        self.consumer = consumer or consumer_name()
        self.block_ms = block_ms
        self.count = count
        self.claim_idle_ms = claim_idle_ms
        self._group_ready = False
        self._pending_cursor: str | None = "0"  # None once own pending records are re-read
        self._outstanding: set[str] = set()  # handed out here, not yet acknowledged
        self._claim_cursor = "0-0"  # XAUTOCLAIM scans the pending list in rounds
        self._buffer: list[dict[str, Any]] = []

    async def read(
        self, count: int | None = None, block_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """Up to ``count`` records (own pending first, then claimed, then new); [] on timeout.

        On a client of its own a read blocks at most the reader's ``block_ms``, which that
        client's socket timeout is sized for (``transports.redis.clients.open_client``).
        """
        count = count or self.count
        if not self._group_ready:
            if self._check_layout:  # a shard's reader leaves both checks to its whole queue
                await check_client_eviction(self.client)
                await agree_on_layout(self.client, self.stream, 1, False, "results reader")
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
        block = self.block_ms if block_ms is None else block_ms
        block = min(block, self.block_ms) if self._owns_client else block
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

    async def ack(self, record_or_id: Mapping[str, Any] | str | bytes) -> bool:
        """Acknowledge one record (or its result id): it will not be delivered again."""
        result_id = result_id_of(record_or_id)
        self._outstanding.discard(result_id)
        if not self.delete_acked:
            return bool(await self.client.xack(self.stream, self.group, result_id))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, result_id)
            pipe.xdel(self.stream, result_id)
            acked, _ = await pipe.execute()
        return bool(acked)
