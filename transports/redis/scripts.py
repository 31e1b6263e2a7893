"""A server-side script on one pooled connection, with the durability wait after it.

``WAIT``/``WAITAOF`` count the writes of the connection that issues them, so the wait
follows the script on the same connection, in the same round trip. Scripts are called by
their SHA1; a server that does not hold one yet (just started, or flushed) answers
NOSCRIPT, and the call is made again with the script's text, which the server then keeps.
A connection that saw any other error is closed, never handed back half-read.

Calls made while the event loop runs other work (many rollouts' puts in one process) go
together (``ScriptBatch``): one connection, one write, one wait after the last script, as
ioredis's auto-pipelining does. Each script is still atomic on its own; the batch saves the
pool, a system call and a loop wake-up per call, and one wait covers every write before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio.connection import ConnectionPool
from redis.exceptions import NoScriptError, ResponseError

from transports.redis.durability import Durability, DurabilityError


def pack(commands: Sequence[Sequence[Any]]) -> bytes:
    """Commands in RESP, for arguments that are bytes, str or int.

    redis-py's packer checks and encodes each argument in Python and splits large values,
    about 0.1 ms for a put's few dozen arguments; this join does the same in a tenth.
    """
    parts: list[bytes] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


async def _send(connection: Any, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send ``commands`` at once and read every reply; an error reply is returned, not raised."""
    await connection.send_packed_command(pack(commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await connection.read_response(disable_decoding=True))
        except ResponseError as error:  # the other replies are still to be read
            replies.append(error)
    return replies


class ScriptBatch:
    """Runs one script on many keys; calls made in the same loop turn share a round trip."""

    def __init__(
        self,
        pool: ConnectionPool,
        script: str,
        sha: str,
        durability: Callable[[], Durability],
    ) -> None:
        self._pool = pool
        self._script = script
        self._sha = sha
        self._durability = durability
        self._pending: list[tuple[str, Callable[[Durability], Sequence[Any]], Any]] = []
        self._sending = 0  # batches on their way
        self._tasks: set[asyncio.Task[None]] = set()  # kept so they are not collected

    async def run(
        self, key: str, args: Callable[[Durability], Sequence[Any]]
    ) -> tuple[Any, list[Any], Durability]:
        """(script reply, wait replies, guarantee), once the batch is back.

        The guarantee is asked once the connection is taken (a connection that opened for
        this batch has just proven its server's own), and ``args`` are made for it. The
        caller decides from the script's reply whether anything was written, and so whether
        the wait replies must be verified. With nothing else on its way, the call is sent
        at once from the caller's own task; else it joins the next batch.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._sending and not self._pending:
            self._sending += 1
            try:
                await self._send([(key, args, future)])
            finally:
                self._sending -= 1
        else:
            if not self._pending:
                loop.call_soon(self._flush)
            self._pending.append((key, args, future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        self._sending += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending -= 1
        self._tasks.discard(task)

    async def _send(self, batch: list[tuple[str, Any, Any]]) -> None:
        futures = [future for _, _, future in batch]
        try:
            connection = await self._pool.get_connection()
        except BaseException as error:
            _fail(futures, error)
            return
        try:
            proven = self._durability()
            keys = [key for key, _, _ in batch]
            values = [args(proven) for _, args, _ in batch]
            count = len(batch)
            calls = [
                ("EVALSHA", self._sha, 1, key, *v) for key, v in zip(keys, values, strict=True)
            ]
            replies = await _send(connection, [*calls, *proven.wait])
            unknown = [n for n in range(count) if isinstance(replies[n], NoScriptError)]
            waited = replies[count:]
            if unknown:
                evals = [("EVAL", self._script, 1, keys[n], *values[n]) for n in unknown]
                again = await _send(connection, [*evals, *proven.wait])
                for n, reply in zip(unknown, again, strict=False):
                    replies[n] = reply
                waited = again[len(unknown) :]
            for reply in waited:
                if isinstance(reply, ResponseError):
                    raise reply
            for future, reply in zip(futures, replies, strict=False):
                if future.done():
                    continue  # its caller gave up waiting
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result((reply, waited, proven))
        except BaseException as error:
            await connection.disconnect()
            _fail(futures, error)
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            await self._pool.release(connection)


def _fail(futures: list[Any], error: BaseException) -> None:
    """Every caller of a failed batch sees its error (and retries its own call)."""
    for future in futures:
        if future.done():
            continue
        if isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error)


async def run_durably(
    pool: ConnectionPool, commands: Sequence[Sequence[Any]], durability: Callable[[], Durability]
) -> list[Any]:
    """``commands`` then the durability wait, on one connection and in one round trip.

    Returns the commands' replies once the wait confirmed them durable; an error reply of a
    command is raised (after every reply was read, so the connection is clean).
    """
    connection = await pool.get_connection()
    try:
        proven = durability()  # asked once the connection is taken (it proved itself)
        replies = await _send(connection, [*commands, *proven.wait])
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        proven.verify(replies[len(commands) :])
        return replies[: len(commands)]
    except (ResponseError, DurabilityError):
        raise  # every reply was read: the connection is clean
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
