"""The rebuild job stream: a collector submits a finished rollout record with one XADD.

A job carries the whole record (the harness transcript, reward, ids) as msgpack, plus the
rollout id in its own field so an operator can read the stream without decoding. The worker
pool (``transports.rebuild.worker``) consumes the stream in one consumer group per service.

Streams are separate keys; on Redis Cluster name them with a shared hash tag (for example
``{tokcap}:rebuild``) so the worker's multi-key steps stay in one slot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgpack
import redis.asyncio as aioredis

from capture.rollout_ids import rollout_id_from_run_body
from transports.redis.keys import as_text, stream_names

JOB_FORMAT_VERSION = 1


class MalformedJobError(ValueError):
    """A job that can never be rebuilt, however often it is retried."""


def encode_job(record: Mapping[str, Any]) -> dict[str, Any]:
    """Stream fields of one job; the rollout id is checked here so a typo fails at submit."""
    if not isinstance(record, Mapping):
        raise MalformedJobError(f"a job record must be a JSON object, got {type(record).__name__}")
    rollout_id = rollout_id_from_run_body(record)
    if rollout_id is None:
        raise MalformedJobError(
            "the record names no rollout: set _ng_rollout_id "
            "(or _ng_task_index and _ng_rollout_index)"
        )
    return {
        "v": JOB_FORMAT_VERSION,
        "rollout_id": rollout_id,
        "format": "msgpack",
        "record": msgpack.packb(dict(record), use_bin_type=True),
    }


def decode_job(fields: Mapping[Any, Any]) -> tuple[str, dict[str, Any]]:
    """(rollout id, record) of one stream entry, or MalformedJobError saying what is wrong."""
    fields = {as_text(key): value for key, value in fields.items()}
    if "record" not in fields:
        raise MalformedJobError(
            f"job has no 'record' field (fields: {sorted(fields) or 'none'}); "
            "submit jobs with RebuildQueue.submit or `tokcap submit`"
        )
    version = as_text(fields.get("v", JOB_FORMAT_VERSION))
    if version != str(JOB_FORMAT_VERSION):
        raise MalformedJobError(
            f"job format v{version} is not understood by this worker (it reads "
            f"v{JOB_FORMAT_VERSION}); upgrade tokcap"
        )
    fmt = as_text(fields.get("format", "msgpack"))
    payload = fields["record"]
    try:
        if fmt == "msgpack":
            raw = payload if isinstance(payload, bytes) else payload.encode()
            record = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        elif fmt == "json":
            record = json.loads(payload)
        else:
            raise MalformedJobError(f"job record format {fmt!r} is unknown (use msgpack or json)")
    except MalformedJobError:
        raise
    except Exception as exc:
        raise MalformedJobError(f"job record is not valid {fmt}: {exc}") from exc
    if not isinstance(record, dict):
        raise MalformedJobError(f"job record must be an object, got {type(record).__name__}")
    try:
        rollout_id = rollout_id_from_run_body(record)
    except ValueError as exc:
        raise MalformedJobError(f"job record has an invalid rollout id: {exc}") from exc
    if rollout_id is None:
        raise MalformedJobError("job record names no rollout (no _ng_rollout_id)")
    return rollout_id, record


class RebuildQueue:
    """Submit finished rollout records for rebuilding: one XADD per record."""

    def __init__(
        self,
        *,
        url: str | None = None,
        client: aioredis.Redis | None = None,
        stream: str = stream_names().jobs,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("RebuildQueue needs exactly one of url= or client=")
        self._owns_client = client is None
        self.client = client if client is not None else aioredis.Redis.from_url(url)
        self.stream = stream

    async def submit(self, record: Mapping[str, Any]) -> str:
        """Queue one record; returns the job id (the stream entry id)."""
        job_id = await self.client.xadd(self.stream, encode_job(record))
        return as_text(job_id)

    async def pending(self) -> int:
        """Jobs in the stream that no worker has finished yet."""
        return int(await self.client.xlen(self.stream))

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
            self._owns_client = False

    async def __aenter__(self) -> RebuildQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
