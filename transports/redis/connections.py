"""A Redis client whose every connection proves the server keeps writes before it carries one.

Proving the server once at start-up trusts whatever server answers later: a redis-server
restarted from another config, a failover to a replica without AOF, or an eviction policy
set while tokcap runs, comes back on fresh connections that redis-py opens by itself. So
each new connection proves on itself, right after its handshake and before the pool hands
it out, that the server does not evict (``transports.redis.eviction``) and meets the chosen
durability (``transports.redis.durability``); a failed proof closes it and raises, and the
write fails instead of being acknowledged by a server that may lose it.

The pool blocks for a free connection (up to ``pool_timeout_s``) when all
``max_connections`` are in use, instead of failing at once as redis-py's default pool does
(``MaxConnectionsError``): hundreds of concurrent calls on one front end wait their turn.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from transports.redis.checks import NAME_PREFIX
from transports.redis.clients import RedisOptions
from transports.redis.durability import Durability, Execute, check_durability
from transports.redis.eviction import check_eviction

log = logging.getLogger("tokcap.redis")


def connection_name(connection: AbstractConnection) -> str:
    """Where a connection goes, for messages: host and port or socket, never credentials."""
    path = getattr(connection, "path", None)
    if path:
        return f"{NAME_PREFIX}{path}"
    return f"{NAME_PREFIX}{getattr(connection, 'host', '?')}:{getattr(connection, 'port', '?')}"


async def prove_server(
    execute: Execute, chosen: Durability, *, where: str, wait_timeout_ms: int
) -> Durability:
    """The server at ``where`` evicts nothing and meets ``chosen``: what it proved, else raise.

    Eviction is refused whatever the durability: ``durability='none'`` accepts losing
    writes in a crash, not rollouts deleted by a full server while it runs.
    """
    await check_eviction(execute, where)
    return await check_durability(execute, chosen, where=where, wait_timeout_ms=wait_timeout_ms)


class Prover:
    """The durability proof a new connection runs on itself before it is handed out.

    ``durability`` is what the latest connection proved; ``proven`` keeps it per server
    (on a Redis Cluster each master proves its own guarantee, and a failover may bring one
    that proves another, or none).
    """

    def __init__(self, chosen: Durability, wait_timeout_ms: int) -> None:
        self.chosen = chosen
        self.wait_timeout_ms = wait_timeout_ms
        self.durability: Durability | None = None
        self.proven: dict[str, Durability] = {}

    async def prove(self, connection: AbstractConnection) -> None:
        """The handshake, then the proof on this very connection (see the module doc)."""
        await connection.on_connect()
        where = connection_name(connection)

        async def execute(*args: Any) -> Any:
            await connection.send_command(*args)
            return await connection.read_response(disable_decoding=True)

        try:
            proven = await prove_server(
                execute, self.chosen, where=where, wait_timeout_ms=self.wait_timeout_ms
            )
        except BaseException:
            # Never hand out a connection that did not prove itself: redis-py would keep it
            # connected, and the next user would skip the check.
            await connection.disconnect()
            raise
        before = self.proven.get(where, self.durability)
        if before is not None and proven != before:
            log.warning(
                "%s now meets the durability guarantee by %s (was %s)",
                where,
                proven.how or proven.mode,
                before.how or before.mode,
            )
        self.durability = self.proven[where] = proven


class ProvingConnections:
    """The client and its pool; ``durability`` is what the latest connection proved."""

    def __init__(self, options: RedisOptions, chosen: Durability) -> None:
        if not options.url:
            raise ValueError("RedisOptions.url names no Redis")
        self.prover = Prover(chosen, options.wait_timeout_ms)
        pool = BlockingConnectionPool.from_url(
            options.url,
            max_connections=options.max_connections,
            timeout=options.pool_timeout_s,
            socket_timeout=options.socket_timeout_s,
            socket_connect_timeout=options.connect_timeout_s,
            # Retries are the store's (bounded, per operation); redis-py's own would hide
            # outages and reconnect without telling anyone.
            retry=Retry(NoBackoff(), 0),
            redis_connect_func=self.prover.prove,
        )
        self.client = aioredis.Redis.from_pool(pool)

    @property
    def durability(self) -> Durability | None:
        return self.prover.durability
