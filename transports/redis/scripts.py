"""A server-side script on one pooled connection, with the durability wait after it.

``WAIT``/``WAITAOF`` count the writes of the connection that issues them, so the wait
follows the script on the same connection, in the same round trip. Scripts are called by
their SHA1; a server that does not hold one yet (just started, or flushed) answers
NOSCRIPT, and the call is made again with the script's text, which the server then keeps.
A connection that saw any other error is closed, never handed back half-read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio.connection import ConnectionPool
from redis.exceptions import NoScriptError, ResponseError

from transports.redis.durability import Durability


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


async def run_script(
    pool: ConnectionPool,
    script: str,
    sha: str,
    key: str,
    args: Callable[[Durability], Sequence[Any]],
    durability: Callable[[], Durability],
) -> tuple[Any, list[Any], Durability]:
    """Run ``script`` on ``key``, then the wait: (script reply, wait replies, guarantee).

    ``durability`` is asked once the connection is taken (a connection that opened for this
    call has just proven its server's own), and ``args`` are made for that guarantee. The
    caller decides from the script's reply whether anything was written, and so whether the
    wait replies must be verified.
    """
    connection = await pool.get_connection()
    try:
        proven = durability()
        values = args(proven)
        replies = await _send(connection, [("EVALSHA", sha, 1, key, *values), *proven.wait])
        if isinstance(replies[0], NoScriptError):
            replies = await _send(connection, [("EVAL", script, 1, key, *values), *proven.wait])
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies[0], replies[1:], proven
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
