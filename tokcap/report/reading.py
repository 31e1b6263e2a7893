"""Where ``tokcap report`` reads finished records from: a JSON Lines file (``-`` for stdin)
or the results stream in Redis, read whole with XRANGE so the trainer's consumer group is
left as it was. Input it cannot read is a ``BadInput`` naming the file or stream and place.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

from transports.rebuild.layout import mismatch
from transports.rebuild.results import decode_result
from transports.redis.clients import RedisOptions, open_sync_client
from transports.redis.keys import as_text, layout_key, shard_names

_STREAM_PAGE = 64  # results per XRANGE reply; each holds a whole final context


class BadInput(ValueError):
    """Input the report cannot read; the message names the file or stream and the place."""


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """One record per line (``-``: stdin); blank lines are skipped."""
    try:
        # stdin is not ours to close; a file is.
        handle = nullcontext(sys.stdin) if path == "-" else open(path, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from exc
    with handle as lines:
        try:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield _json_object(line, f"{path} line {number}")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot read {path}: {exc}") from exc


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(value, dict):
        raise BadInput(f"{where}: a JSON {type(value).__name__}, not a record object")
    return value


def read_stream(
    url: str, stream: str, shards: int = 1, cluster: bool = False
) -> Iterator[dict[str, Any]]:
    """Every result on the stream (each of its shards in turn), oldest first, decoded as
    ``ResultsReader`` decodes them.

    XRANGE reads without a consumer group, so nothing is claimed or acknowledged; results the
    trainer already acknowledged were deleted by it and are not seen. A rollout's results
    are all on one shard, so its latest still wins.
    """
    client = open_sync_client(RedisOptions(url=url, cluster=cluster))
    try:
        problem = mismatch(stream, client.get(layout_key(stream)), shards, cluster, "report")
        if problem is not None:
            raise BadInput(problem)
        for name in shard_names(stream, shards, tagged=cluster):
            yield from _read_one(client, name)
    finally:
        client.close()


def _read_one(client: Any, stream: str) -> Iterator[dict[str, Any]]:
    start = "-"
    while entries := client.xrange(stream, min=start, count=_STREAM_PAGE):
        for entry_id, fields in entries:
            try:
                yield decode_result(entry_id, fields)
            except Exception as exc:
                raise BadInput(f"{stream} entry {as_text(entry_id)}: {exc}") from exc
        start = "(" + as_text(entries[-1][0])
