"""Publishing a rebuilt record to the results stream, at most once per snapshot version.

One Lua script decides and writes in one step, so two workers that rebuilt the same
snapshot (one of them claimed the other's job) publish one result between them, a result
that names the one it supersedes when a late loss changed the snapshot, and never an older
build after a newer one. The durability wait rides in the same pipeline, or, through the
store (``publish_durably``), on the same connection to the master that holds the result's
shard: on a Redis Cluster the guard, the results stream and the rollout's latest result
share the shard's hash tag, so the script and its ``WAIT`` go to one master.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from capture.delivery import RolloutBuild
from transports.rebuild.results import SUPERSEDES_FIELD
from transports.redis import keys as k
from transports.redis.keys import as_text

# Publish a result unless this (rollout, snapshot, version) was published before; the guard
# keeps "<result id> <1 if unmasked else 0>", so a repeat knows what the trainer received. On a
# repeat the guard's TTL is refreshed: that write makes WAIT/WAITAOF on this connection also
# cover the first publish, which a killed worker may never have seen made durable.
# KEYS: guard, results stream, the rollout's latest result ("<id> <snapshot id> <version>").
# ARGV: ttl ms, ok flag, snapshot id ('' for none), version, name of the supersedes field,
# then the result's stream fields. A newer version of the same snapshot already published
# makes this one stale: nothing is written (reply 2), since a trainer must never receive an
# older build after a newer one. An older version is superseded by this one.
PUBLISH_ONCE = """
local existing = redis.call('GET', KEYS[1])
if existing then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return {0, existing, ''}
end
local snapshot, version = ARGV[3], tonumber(ARGV[4])
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
local supersedes = ''
if snapshot ~= '' then
  local latest = redis.call('GET', KEYS[3])
  if latest then
    local id, seen, seen_version = string.match(latest, '^(%S+) (%S+) (%d+)$')
    if seen == snapshot and tonumber(seen_version) > version then
      return {2, id, ''}
    end
    if seen == snapshot and tonumber(seen_version) < version then
      supersedes = id
      fields[#fields + 1] = ARGV[5]
      fields[#fields + 1] = id
    end
  end
end
local id = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('SET', KEYS[1], id .. ' ' .. ARGV[2], 'PX', ARGV[1])
if snapshot ~= '' then
  redis.call('SET', KEYS[3], id .. ' ' .. snapshot .. ' ' .. ARGV[4], 'PX', ARGV[1])
end
return {1, id .. ' ' .. ARGV[2], supersedes}
"""


@dataclass(frozen=True)
class Published:
    """What the trainer receives for one snapshot version, as the publish guard says."""

    result_id: str
    fresh: bool  # written by this call, not found from an earlier run
    ok: bool  # that result is an unmasked build (a guard of an older worker: unknown, False)
    supersedes: str = ""  # the result id this one replaces, when it is fresh
    stale: bool = False  # a newer version of the snapshot was published: nothing was written


@dataclass(frozen=True)
class ResultToPublish:
    """One rebuilt record on its way to the results stream, and what names it."""

    results_stream: str
    rollout_id: str
    job_id: str
    built: RolloutBuild
    fields: Mapping[str, Any]  # the stream entry's fields (``encode_result``)


class DurableRunner(Protocol):
    """Runs commands on one key's slot, then the durability wait (``RedisTokenStore``)."""

    async def run_durably(self, key: str, commands: Any) -> list[Any]: ...


def _publish_call(result: ResultToPublish, guard_ttl_s: int) -> tuple[Any, ...]:
    """The EVAL of the publish script for ``result``; its first key is the guard."""
    built = result.built
    snapshot_id = built.snapshot_id or ""
    guard = k.publish_guard_key(
        result.results_stream, result.rollout_id, snapshot_id, built.version, result.job_id
    )
    latest = k.latest_result_key(result.results_stream, result.rollout_id)
    ok_flag = "1" if built.ok and not built.masked else "0"
    args: list[Any] = [guard_ttl_s * 1000, ok_flag, snapshot_id, built.version, SUPERSEDES_FIELD]
    for key, value in result.fields.items():
        args += [key, value]
    return ("EVAL", PUBLISH_ONCE, 3, guard, result.results_stream, latest, *args)


async def publish_durably(
    store: DurableRunner, result: ResultToPublish, *, guard_ttl_s: int
) -> Published:
    """XADD the result unless its snapshot version was published before, through the store:
    durable on return, on one connection to the server (on a cluster,
    the master) holding the result's shard, with the wait that server proved it needs."""
    call = _publish_call(result, guard_ttl_s)
    (reply,) = await store.run_durably(call[3], [call])
    return _published(reply)


def _published(reply: list[Any]) -> Published:
    """Read the publish script's reply: (0 found | 1 written | 2 stale, guard, supersedes)."""
    status, guarded, supersedes = int(reply[0]), as_text(reply[1]), as_text(reply[2])
    result_id, _, ok_flag = guarded.partition(" ")
    return Published(
        result_id=result_id,
        fresh=status == 1,
        ok=status != 2 and ok_flag == "1",
        supersedes=supersedes if status == 1 else "",
        stale=status == 2,
    )
