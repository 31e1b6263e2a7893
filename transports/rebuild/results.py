"""The results stream: rebuilt records on their way to the trainer.

The worker publishes each rebuilt record once per (rollout, snapshot id, version). The trainer
reads them in its own consumer group with ``transports.rebuild.reader.ResultsReader`` and
acknowledges a record only when its own handoff is durable; an unacknowledged record is
delivered again (to the same consumer after a restart, or to another one after
``claim_idle_ms``).

A result can supersede an earlier one of the same rollout: when a late loss mark changed the
snapshot after its result was published, the worker publishes the rebuilt record with a
``supersedes`` field naming the earlier result id, and ``decode_result`` puts it on the record
as ``_ng_supersedes``. The newer result is authoritative (see the README's trainer section).

On the wire a token-bearing item whose ``prompt_token_ids`` extends the previous item's
prompt + generation stores only the new tail, so a result grows with the final context,
not with turns x context; its routed experts, likewise, only the rows after the previous
item's, as raw uint16 bytes. Each segment of ``delivery: segments`` is compacted the same way. ``decode_result`` restores the exact arrays (routes as
``capture.routes.Routes``, whose ``to_numpy()`` is the trainer's array).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from capture.build.segments import SEGMENTS_KEY
from capture.codec.views import IdView, json_default, shares_prefix
from capture.routes import Routes
from transports.redis.keys import as_text

RESULT_ID_KEY = "_ng_result_id"
SUPERSEDES_KEY = "_ng_supersedes"  # on a decoded record: the result id this one replaces
SUPERSEDES_FIELD = "supersedes"  # the same, as a stream field beside the record
_PREFIX_MARK = "_tokcap_prompt_prefix"
_ROUTES_MARK = "_tokcap_routes_prefix"  # the item's routes continue the previous item's
ROUTES_KEY = "routed_experts"


def _output_items(record: Mapping[str, Any]) -> list[Any] | None:
    response = record.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    return output if isinstance(output, list) else None


def compact_record(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of the record whose prompts (and routes) store only what extends the previous
    item, in ``response.output`` and in each segment's ``output``.

    Views of one chain's sequence (``capture.codec.views``) are proven to extend the
    previous item by identity; lists are compared. Either way no prompt is copied whole.
    """
    items = _output_items(record)
    if items:
        record = {**record, "response": {**record["response"], "output": _compact(items)}}
    segments = record.get(SEGMENTS_KEY)
    if isinstance(segments, list):
        record = {**record, SEGMENTS_KEY: [_compact_segment(s) for s in segments]}
    return record


def _compact_segment(segment: Any) -> Any:
    if not isinstance(segment, dict) or not isinstance(segment.get("output"), list):
        return segment
    return {**segment, "output": _compact(segment["output"])}


def _compact(items: list[Any]) -> list[Any]:
    """One chain's items, each storing only what extends the item before it."""
    compacted = []
    previous: tuple[Sequence[int], Sequence[int]] | None = None
    routes: Routes | None = None
    for item in items:
        prompt = item.get("prompt_token_ids") if isinstance(item, dict) else None
        if not isinstance(prompt, (list, IdView)):
            compacted.append(item)
            continue
        out = item
        shared = _shared_prefix(prompt, previous)
        if shared:
            out = {**item, _PREFIX_MARK: shared, "prompt_token_ids": prompt[shared:]}
        if isinstance(item.get(ROUTES_KEY), Routes):
            out, routes = _compact_routes(out, routes)
        compacted.append(out)
        generation = item.get("generation_token_ids")
        previous = (prompt, generation if isinstance(generation, (list, IdView)) else [])
    return compacted


def _compact_routes(item: dict[str, Any], before: Routes | None) -> tuple[dict[str, Any], Routes]:
    """The item with its routes packed, only the rows after ``before``'s where they
    continue them; and its routes, for the next item."""
    routes: Routes = item[ROUTES_KEY]
    shared = routes.shared_rows(before) if before is not None else 0
    out = {**item, ROUTES_KEY: routes.rows_from(shared).packed()}
    if shared:
        out[_ROUTES_MARK] = shared
    return out, routes


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
    _expand(_output_items(record) or [])
    for segment in record.get(SEGMENTS_KEY) or []:
        if isinstance(segment, dict) and isinstance(segment.get("output"), list):
            _expand(segment["output"])
    return record


def _expand(items: list[Any]) -> None:
    sequence: list[int] = []
    routes: Routes | None = None
    for item in items:
        packed = item.get(ROUTES_KEY) if isinstance(item, dict) else None
        if isinstance(packed, Mapping) and "bytes" in packed:
            routes = _expand_routes(item, routes)
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


def _expand_routes(item: dict[str, Any], before: Routes | None) -> Routes:
    """Undo ``_compact_routes`` in place: the item's routes, whole (sharing ``before``'s)."""
    shared = item.pop(_ROUTES_MARK, None)
    if shared is not None and (before is None or before.rows != shared):
        raise ValueError(f"result routes extend {shared} rows the item before does not hold")
    routes = Routes.from_packed(item[ROUTES_KEY], before if shared else None)
    item[ROUTES_KEY] = routes
    return routes


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
