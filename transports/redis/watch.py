"""Optimistic transactions on one Redis connection: WATCH, read, MULTI ... EXEC, then wait.

The pattern is arq's ``enqueue_job``: watch the key, read what decides, queue the writes in
MULTI, and treat a nil EXEC as "lost the race" (``attempt``, below). It runs on one connection taken from the
pool rather than through a pipeline object for two reasons: ``WAIT``/``WAITAOF`` count the
writes of the connection that issues them, so the durability wait must follow EXEC on that
same connection; and WATCH plus the reads, and EXEC plus the wait, can each travel as one
round trip. A connection that saw any error is closed, never handed back half-read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from redis.asyncio.connection import ConnectionPool

from transports.redis.durability import Durability
from transports.redis.plans import Command, Operation, Plan


class Watch:
    """One WATCH on one key, on one connection; read once, then commit or walk away."""

    def __init__(self, connection: Any, key: str) -> None:
        self._connection = connection
        self._key = key
        self.watching = False

    async def _roundtrip(self, commands: Sequence[Command]) -> list[Any]:
        connection = self._connection
        await connection.send_packed_command(connection.pack_commands(commands))
        replies = []
        for _ in commands:
            replies.append(await connection.read_response(disable_decoding=True))
        return replies

    async def read(self, *commands: Command) -> list[Any]:
        """WATCH the key and run ``commands`` in the same round trip; returns their replies."""
        replies = await self._roundtrip([("WATCH", self._key), *commands])
        self.watching = True
        return replies[1:]

    async def commit(
        self, writes: Sequence[Command], after: Sequence[Command] = ()
    ) -> tuple[list[Any], list[Any]] | None:
        """MULTI, ``writes``, EXEC, then ``after`` (the durability wait) in one round trip.

        Returns (EXEC replies, ``after`` replies), or None when EXEC was refused because the
        watched key changed: the caller lost the race and must read and decide again. The
        wait is only sent along when the EXEC may succeed; after a refused EXEC it is a
        harmless no-op that waits for nothing new.
        """
        replies = await self._roundtrip([("MULTI",), *writes, ("EXEC",), *after])
        self.watching = False
        executed = replies[len(writes) + 1]
        if executed is None:
            return None
        return list(executed), replies[len(writes) + 2 :]

    async def unwatch(self) -> None:
        if self.watching:
            await self._roundtrip([("UNWATCH",)])
            self.watching = False


async def execute_raw(pool: ConnectionPool, *args: Any) -> Any:
    """One command on a pooled connection, its reply undecoded and unparsed (bytes, lists)."""
    connection = await pool.get_connection()
    try:
        await connection.send_command(*args)
        return await connection.read_response(disable_decoding=True)
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


@asynccontextmanager
async def watching(pool: ConnectionPool, key: str) -> AsyncIterator[Watch]:
    """A Watch on ``key``; its connection goes back to the pool clean, or is closed."""
    connection = await pool.get_connection()
    watch = Watch(connection, key)
    try:
        yield watch
        await watch.unwatch()
    except BaseException:
        # Unread replies or a live WATCH must not reach the next user of this connection.
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


async def attempt(
    pool: ConnectionPool, key: str, operation: Operation, durability: Callable[[], Durability]
) -> Plan | None:
    """Run ``operation`` once as a transaction on ``key``; None when it lost the race.

    ``durability`` gives the guarantee to wait for, asked only once the connection is
    taken: a connection that opened for this attempt has just proven its server's own.
    """
    async with watching(pool, key) as watch:
        plan = operation.decide(key, await watch.read(*operation.reads(key)))
        if not plan.writes:
            return plan
        proven = durability()
        committed = await watch.commit(plan.writes, after=proven.wait)
    if committed is None:
        # Lost the race: another writer changed this rollout after our WATCH, so what we
        # decided on is stale. Nothing was applied; the caller reads and decides again.
        return None
    proven.verify(committed[1])
    return plan
