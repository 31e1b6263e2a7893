"""The front end's HTTP to the engine: which failures are tried once more on a fresh connection."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from api.engine.http import EngineHTTP

REPLY = (
    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
)


async def engine_that_resets(first: int) -> tuple[asyncio.Server, list[bytes]]:
    """A TCP server on 127.0.0.1 that resets its first ``first`` connections once a request
    came in (as a kernel does to a connection its full listen queue could not take), then
    answers; it records each request line it read."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b"\r\n")[0])
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        sock = writer.get_extra_info("socket")
        if len(seen) <= first:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # SO_LINGER 0: the close is a reset
            return
        writer.write(REPLY)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), seen


async def test_a_connection_reset_before_the_answer_is_tried_once_more() -> None:
    server, seen = await engine_that_resets(first=1)
    port = server.sockets[0].getsockname()[1]
    http = EngineHTTP(f"http://127.0.0.1:{port}", headers={}, timeout_s=10)
    try:
        assert await http.post("/v1/chat/completions", b"{}") == (200, b'{"ok":true}')
        assert seen == [b"POST /v1/chat/completions HTTP/1.1"] * 2
    finally:
        await http.close()
        server.close()
        await server.wait_closed()


async def test_a_second_reset_is_the_engine_unreachable() -> None:
    server, seen = await engine_that_resets(first=2)
    port = server.sockets[0].getsockname()[1]
    http = EngineHTTP(f"http://127.0.0.1:{port}", headers={}, timeout_s=10)
    try:
        with pytest.raises(OSError):
            await http.post("/v1/chat/completions", b"{}")
        assert len(seen) == 2  # tried once more, not again and again
    finally:
        await http.close()
        server.close()
        await server.wait_closed()
