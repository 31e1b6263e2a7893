"""The rebuild job stream: a collector submits a finished rollout record with one XADD.

A job carries the whole record (the harness transcript, reward, ids) as msgpack, plus the
rollout id in its own field so an operator can read the stream without decoding. The worker
pool (``transports.rebuild.worker``) consumes the stream in one consumer group per service.

The queue can be sharded: ``shards`` job streams (``transports.redis.keys.shard_streams``),
each named with a hash tag of its own so that on a Redis Cluster they spread over the
masters while each shard's keys share one slot. A job goes to the shard of its rollout id
(``shard_of``), so the submitter needs no coordination and a re-submission lands beside the
first. On a cluster the streams are always hash-tagged, even with one shard; on one Redis,
one shard keeps the plain names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from capture.rollout_ids import rollout_id_from_run_body
from transports.rebuild.layout import agree_on_layout
from transports.redis.clients import RedisOptions, open_client
from transports.redis.eviction import check_client_eviction
from transports.redis.keys import as_text, shard_names, shard_of, stream_names

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
    """Submit finished rollout records for rebuilding: one XADD per record.

    ``stream`` names the jobs stream (with ``shards`` > 1 or on a cluster, the base of the
    shards' names); ``cluster`` says the url names a node of a Redis Cluster (a
    ``RedisCluster`` client passed in says so too). Workers must read the same shards.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        client: aioredis.Redis | RedisCluster | None = None,
        stream: str = stream_names().jobs,
        shards: int = 1,
        cluster: bool = False,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("RebuildQueue needs exactly one of url= or client=")
        cluster = cluster or isinstance(client, RedisCluster)
        self.streams = shard_names(stream, shards, tagged=cluster)
        self._owns_client = client is None
        options = RedisOptions(url=url, cluster=cluster)
        self.client = client if client is not None else open_client(options)
        self.stream = self.streams[0]
        self._base, self._cluster = stream, cluster
        self._layout_agreed = False

    def stream_of(self, rollout_id: str) -> str:
        """The jobs stream (shard) that takes this rollout's jobs."""
        return self.streams[shard_of(rollout_id, len(self.streams))]

    async def submit(self, record: Mapping[str, Any]) -> str:
        """Queue one record on its rollout's shard; returns the job id (the entry id)."""
        fields = encode_job(record)
        if not self._layout_agreed:
            shards = len(self.streams)
            await check_client_eviction(self.client)
            await agree_on_layout(self.client, self._base, shards, self._cluster, "submitter")
            self._layout_agreed = True
        job_id = await self.client.xadd(self.stream_of(fields["rollout_id"]), fields)
        return as_text(job_id)

    async def pending(self) -> int:
        """Jobs in the streams that no worker has finished yet."""
        return sum([int(await self.client.xlen(stream)) for stream in self.streams])

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
            self._owns_client = False

    async def __aenter__(self) -> RebuildQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
