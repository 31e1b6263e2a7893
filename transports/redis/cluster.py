"""The store on a Redis Cluster: each rollout is served by the master of its slot.

Every key of a rollout carries the hash tag ``{<rollout_id>}``, so a rollout lives in one
slot, on one master. The put script, WATCH/MULTI and the durability wait after them run on
one connection of that master, exactly as on a single node (``transports.redis.watch``,
``transports.redis.scripts``): ``ClusterConnections.pool_for(key)`` hands out that
master's connections the way a redis-py pool does. The slot map is redis-py's
(``redis.asyncio.cluster.RedisCluster``); the store re-reads it (``refresh``) when a reply
says the slot moved, the cluster is electing a new master, or a master does not answer.

Durability is proven by every connection as it opens, against the master it opens to
(``transports.redis.connections.Prover``), so each master proves its own guarantee: AOF
``always`` on each, or ``replicas:N`` whose ``WAIT`` follows the write on the same
connection to the slot's master. A replica promoted by a failover proves itself on its
first connection; with ``replicas:N`` it has no replica until the lost master comes back
(or another is attached), so writes to its slots wait and then fail, never acknowledged
without the guarantee.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from capture.errors import ConfigError
from transports.redis.checks import node_name
from transports.redis.clients import RedisOptions
from transports.redis.connections import Prover
from transports.redis.durability import Durability

_SPARE_CONNECTIONS = 4


class NodePool:
    """One master's connections, lent out like a redis-py pool (``get_connection``,
    ``release``); at most ``max_connections`` at once, a caller waits ``timeout_s`` for one."""

    def __init__(self, node: ClusterNode, prover: Prover, limit: int, timeout_s: float) -> None:
        self.node = node
        self.name = node_name(node)
        self._prover = prover
        self._timeout_s = timeout_s
        self._free = asyncio.Semaphore(limit)

    def durability(self) -> Durability:
        """What this master's connections proved; asked once a connection is taken."""
        proven = self._prover.proven.get(self.name) or self._prover.durability
        assert proven is not None, "a connection of this master proved itself first"
        return proven

    async def get_connection(self) -> Any:
        """A connected connection of this master, proven as it opened."""
        try:
            await asyncio.wait_for(self._free.acquire(), self._timeout_s)
        except TimeoutError:
            raise RedisConnectionError(  # as redis-py's blocking pool says it
                f"No connection available to {self.name} within {self._timeout_s} s"
            ) from None
        connection = self.node.acquire_connection()
        try:
            await connection.connect()
        except BaseException:
            await connection.disconnect()
            self.node.release(connection)
            self._free.release()
            raise
        return connection

    async def release(self, connection: Any) -> None:
        self.node.release(connection)
        self._free.release()


class ClusterConnections:
    """A RedisCluster client whose node connections prove durability, and its pools."""

    def __init__(
        self, options: RedisOptions, chosen: Durability, client: RedisCluster | None = None
    ) -> None:
        self.prover = Prover(chosen, options.wait_timeout_ms)
        self._pool_timeout_s = options.pool_timeout_s
        max_connections = self._max_connections = options.max_connections
        if client is None:
            client = RedisCluster.from_url(
                options.url,
                # A few beyond the store's own, for redis-py's reads of the slot map.
                max_connections=max_connections + _SPARE_CONNECTIONS,
                socket_timeout=options.socket_timeout_s,
                socket_connect_timeout=options.connect_timeout_s,
            )
        elif client.nodes_manager.nodes_cache:
            raise ConfigError(
                "pass a RedisCluster client that has not connected yet (its open connections "
                "never proved durability), or url= with cluster=True"
            )
        else:
            room = client.connection_kwargs.get("max_connections", max_connections)
            self._max_connections = max(1, min(max_connections, room - _SPARE_CONNECTIONS))
        # Nodes are made from these kwargs as the slot map is read: every connection of
        # every node then runs the proof as it opens.
        client.connection_kwargs["redis_connect_func"] = self.prover.prove
        self.client = client
        self._pools: dict[str, NodePool] = {}

    async def start(self) -> list[NodePool]:
        """Read the slot map and prove every master; returns their pools."""
        await self.client.initialize()
        pools = self.masters()
        for pool in pools:
            connection = await pool.get_connection()
            await pool.release(connection)
        return pools

    def pool_for(self, key: str) -> NodePool:
        """The pool of the master serving ``key``'s slot, as the slot map says now."""
        return self._pool(self.client.get_node_from_key(key))

    def masters(self) -> list[NodePool]:
        return [self._pool(node) for node in self.client.get_primaries()]

    def _pool(self, node: ClusterNode) -> NodePool:
        pool = self._pools.get(node.name)
        if pool is None or pool.node is not node:
            pool = NodePool(node, self.prover, self._max_connections, self._pool_timeout_s)
            self._pools[node.name] = pool
        return pool

    async def refresh(self) -> None:
        """Read the slot map again (after a failover, a MOVED reply, a lost master)."""
        await self.client.nodes_manager.initialize()

    async def aclose(self) -> None:
        await self.client.aclose()
