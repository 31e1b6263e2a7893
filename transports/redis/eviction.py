"""Whether a Redis server may evict tokcap's keys, and how full it is.

Durability keeps an acknowledged entry through a crash; eviction is the other way Redis
drops data. Under an ``allkeys-*`` policy a full server deletes whole rollout hashes, and
the rollout's next put makes the hash anew: its later calls then look like a complete
chain without the earlier ones. Under a ``volatile-*`` policy only keys with a TTL go, and
tokcap's are the ones that must outlive late writers: a tombstone evicted early lets a late
write after a drop recreate the rollout (and a rollout id used again would inherit it), a
frozen rollout kept as evidence loses its evidence, and a publish guard evicted early lets a
re-run job publish a second result for a rollout the trainer already has. So only
``noeviction`` is accepted: a full server then refuses writes, the calls' losses are recorded
and their rollouts masked. The policy is read from ``INFO memory``, which managed services
answer even where ``CONFIG`` is disabled, on every new connection, beside the durability
proof, because an operator can change it while tokcap runs (the queues and results
readers, whose clients are plain redis-py ones, check once, at first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from capture.errors import ConfigError
from transports.redis.checks import address_of, node_name, server_name
from transports.redis.durability import Execute, info_fields

ACCEPTED_POLICY = "noeviction"


class EvictingRedisError(ConfigError):
    """The server may delete tokcap's keys to free memory; it is refused."""


@dataclass(frozen=True)
class Memory:
    """One server's memory as ``INFO memory`` reports it (``max_bytes`` 0: no limit)."""

    where: str
    used_bytes: int
    max_bytes: int
    policy: str

    @property
    def used_fraction(self) -> float | None:
        """Used memory over ``maxmemory``; None when the server sets no limit."""
        return self.used_bytes / self.max_bytes if self.max_bytes else None

    @property
    def server(self) -> str:
        """The server's host:port (or socket path), without the words around it."""
        return address_of(self.where)

    def as_dict(self) -> dict[str, Any]:
        return {
            "server": self.where,
            "used_bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "used_fraction": self.used_fraction,
            "policy": self.policy,
        }


async def read_memory(execute: Execute, where: str) -> Memory:
    """What ``INFO memory`` says of the server at ``where``."""
    info = info_fields(await execute("INFO", "memory"))
    return Memory(
        where=where,
        used_bytes=int(info.get("used_memory", "0") or 0),
        max_bytes=int(info.get("maxmemory", "0") or 0),
        policy=info.get("maxmemory_policy", ""),
    )


def refuse_eviction(memory: Memory) -> None:
    """Raise unless the server keeps every key until it is deleted (see the module doc)."""
    if memory.policy == ACCEPTED_POLICY:
        return
    fix = (
        "set maxmemory-policy noeviction (redis.conf, CONFIG SET, or your managed service's "
        "parameter group), or give tokcap a Redis of its own"
    )
    if not memory.policy:
        raise EvictingRedisError(
            f"cannot tell whether {memory.where} evicts keys: INFO memory names no "
            f"maxmemory_policy; {fix}"
        )
    what = (
        "any key, rollouts being written included"
        if memory.policy.startswith("allkeys-")
        else "keys with a TTL: tokcap's tombstones, kept evidence and publish guards"
        if memory.policy.startswith("volatile-")
        else "keys"
    )
    raise EvictingRedisError(
        f"{memory.where} runs maxmemory-policy {memory.policy}: when full it evicts {what}, "
        f"and an evicted rollout loses calls its harness was answered for; {fix}"
    )


async def check_eviction(execute: Execute, where: str) -> Memory:
    """Read the server's memory and refuse it if it may evict; its readout otherwise."""
    memory = await read_memory(execute, where)
    refuse_eviction(memory)
    return memory


async def check_client_eviction(client: Any) -> None:
    """The same refusal for a plain redis-py client (a queue's, a results reader's): every
    server it reaches, each master of a cluster, must keep its keys."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        for node in client.get_primaries():

            async def on_node(*args: Any, node: Any = node) -> Any:
                return await client.execute_command(*args, target_nodes=node)

            await check_eviction(on_node, node_name(node))
        return
    await check_eviction(client.execute_command, server_name(client))
