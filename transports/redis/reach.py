"""How a store reaches its Redis: one server, or the masters of a Redis Cluster.

``RedisReach`` owns the client and its connections, proves the chosen durability before the
first write (every connection of a pool it built proves itself as it opens, see
``transports.redis.connections`` and ``transports.redis.cluster``), names the pool that
serves a key with the guarantee that pool proved, and retries an operation through lost
connections and a cluster's failover (in ``capture.outage``'s loop, the one the capture
context and the rebuild worker share). The store decides what to write; this decides where
it goes and rides out the outages on the way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import AuthenticationError

from capture.errors import ConfigError, TokenCaptureError
from capture.outage import Backoff, OutageOutlasted, retry_through_outage
from transports.redis.checks import server_name
from transports.redis.clients import TRANSIENT_ERRORS, RedisOptions
from transports.redis.cluster import ClusterConnections
from transports.redis.connections import ProvingConnections, prove_server
from transports.redis.durability import Durability
from transports.redis.eviction import EvictingRedisError, Memory, read_memory
from transports.redis.watch import execute_raw

log = logging.getLogger("tokcap.redis")
T = TypeVar("T")
# A connection failure is retried after 50 ms, doubling up to 0.5 s between attempts.
RETRY_PAUSE_S, RETRY_MAX_PAUSE_S = 0.05, 0.5
_BACKOFF = Backoff(RETRY_PAUSE_S, RETRY_MAX_PAUSE_S)


class RedisUnavailableError(TokenCaptureError, ConnectionError):
    """Redis could not be reached within the bounded retries; nothing is assumed stored."""


class RedisReach:
    """The client, its proven connections and the retries of one store, all from one
    ``RedisOptions`` (``chosen`` is its parsed ``durability``); ``client``: one passed in."""

    def __init__(self, options: RedisOptions, client: Any = None) -> None:
        self.options = options
        self.client = client
        self.owns_client = client is None
        self.chosen = Durability.parse(options.durability)
        self.cluster = options.cluster
        self.durability: Durability | None = None  # set once proven against the server
        self._connections: ProvingConnections | None = None  # None for a client passed in
        self._cluster: ClusterConnections | None = None
        self._lock = asyncio.Lock()

    @property
    def where(self) -> str:
        """The server, for messages; never the password."""
        if self.client is None:
            return "redis (not connected yet)"
        return server_name(self.client)

    async def check(self) -> Durability:
        """Connect and prove the durability guarantee once; what it is now, after that."""
        if self.durability is None:
            async with self._lock:
                if self.durability is None:
                    self.durability = await self.retrying(self._prove)
                    if self.durability.mode == "none":  # the explicit opt-out, said once
                        log.warning(
                            "durability='none': writes to %s are not made durable before "
                            "put returns; a Redis crash can lose acknowledged entries",
                            self.where,
                        )
        return self._current_durability()

    async def _prove(self) -> Durability:
        """The first proof: a connection of our own pool proves itself as it opens."""
        if self.cluster:
            return await self._prove_cluster()
        if self.client is None:
            self._connections = ProvingConnections(self.options, self.chosen)
            self.client = self._connections.client
        pool = self.client.connection_pool
        if self._connections is not None:
            connection = await pool.get_connection()
            await pool.release(connection)
            assert self._connections.durability is not None
            return self._connections.durability

        async def execute(*args: Any) -> Any:
            return await execute_raw(pool, *args)

        return await prove_server(
            execute,
            self.chosen,
            where=self.where,
            wait_timeout_ms=self.options.wait_timeout_ms,
        )

    async def _prove_cluster(self) -> Durability:
        """Every master proves the guarantee on a connection of its own (see cluster.py)."""
        if self._cluster is None:
            self._cluster = ClusterConnections(self.options, self.chosen, client=self.client)
            self.client = self._cluster.client
        masters = await self._cluster.start()
        return masters[0].durability()

    def route(self, key: str) -> tuple[Any, Callable[[], Durability]]:
        """The pool that serves ``key`` and the guarantee its connections proved."""
        if self._cluster is not None:
            pool = self._cluster.pool_for(key)
            return pool, pool.durability
        return self.client.connection_pool, self._current_durability

    def pools(self) -> list[Any]:
        """Every server's pool: a cluster's masters in turn, or the one server's."""
        if self._cluster is not None:
            return list(self._cluster.masters())
        return [self.client.connection_pool]

    async def memory(self) -> list[Memory]:
        """``INFO memory`` of every server the store writes to (a cluster's masters)."""

        async def read(pool: Any) -> Memory:
            async def execute(*args: Any) -> Any:
                return await execute_raw(pool, *args)

            return await read_memory(execute, getattr(pool, "name", None) or self.where)

        return [await self.retrying(lambda pool=pool: read(pool)) for pool in self.pools()]

    def _current_durability(self) -> Durability:
        """What the latest connection proved (a server may come back configured otherwise)."""
        if self._connections is not None and self._connections.durability is not None:
            return self._connections.durability
        assert self.durability is not None
        return self.durability

    async def retrying(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation``; on a connection failure retry it a bounded number of times.

        Every operation of the store is safe to repeat: a put whose EXEC landed but whose
        reply was lost finds its own digest on the retry and returns as a no-op.
        """
        # A cluster replacing a lost master is unreachable for a while (its node timeout,
        # then an election): keep trying that long, on a fresh slot map each time.
        deadline = time.monotonic() + (self.options.failover_timeout_s if self.cluster else 0)

        def pause_after(failures: int) -> float | None:
            if failures > self.options.max_retries and time.monotonic() >= deadline:
                return None
            return _BACKOFF.after(failures)

        try:
            return await retry_through_outage(
                operation, is_outage=self.is_outage, pause_after=pause_after, between=self.refresh
            )
        except OutageOutlasted as outlasted:
            raise RedisUnavailableError(
                f"{self.where} unreachable after {outlasted.failures} attempts: {outlasted.last}"
            ) from outlasted.last

    def is_outage(self, exc: Exception) -> bool:
        """Whether ``exc`` may pass by waiting: a lost connection, or on a cluster a master
        promoted after start that cannot prove the guarantee yet.

        Public because the rebuild worker reads its jobs through this client's proving
        connections, so its reads meet the same refusals and must wait them out the same way.
        """
        if isinstance(exc, AuthenticationError):
            return False  # wrong credentials do not get better by retrying
        if isinstance(exc, TRANSIENT_ERRORS):
            return True
        if not isinstance(exc, ConfigError):
            return False
        # With replicas:N, a promoted master proves it once its lost peer is back as its
        # replica: wait for that. A master that evicts is not promoted out of it: fail now.
        promoted = self.cluster and self.durability is not None
        return promoted and not isinstance(exc, EvictingRedisError)

    async def refresh(self) -> None:
        """Read a cluster's slot map again; a failure is the next attempt's to report.

        Needed besides redis-py's own re-reads: a map read from a node with a stale view
        can name a replica as a slot's master, whose new connections then fail their proof
        before any command could answer MOVED, so redis-py never learns the map is wrong.
        """
        if self._cluster is None:
            return
        try:
            await self._cluster.refresh()
        except TRANSIENT_ERRORS:
            pass

    async def close(self) -> None:
        """Close a client we built; a client passed in keeps running, minus our pools."""
        if self.owns_client and self.client is not None:
            await self.client.aclose()
        elif self._cluster is not None:
            self.client.connection_kwargs.pop("redis_connect_func", None)
