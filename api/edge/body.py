"""What a client may send: bounded bodies, bounded bytes in flight, bounded time.

Anything a client sends gets a clear 4xx (or a retryable 503 when the server is merely
busy), never a 500 or a memory blow-up. ``BodyLimit`` reads each request body before the
app sees it: beyond ``max_body_bytes`` it answers 413. The bodies being read and parsed
share ``max_inflight_bytes`` (``ByteBudget``), because parsing turns every body byte into
several bytes of Python objects. A body whose declared size does not fit waits its turn,
first come first served, before a byte of it is read: the server stops reading that
socket (uvicorn pauses a connection once 64 KiB of body are buffered), so a burst of large
bodies waits in the clients and the kernel, not in this process. Only a call that waited
``body_wait_s`` is answered a retryable 503. A body that has not arrived
``body_timeout_s`` after its turn came is cut with a 408. A body counts until the app has
translated it and calls ``release_body`` (``RELEASE_KEY`` in the scope), not while the call
waits on the engine: by then what the call holds is the request it sent, about the body's
size, and the engine, not this guard, decides how many calls wait at once. The body is
then parsed by ``api.edge.json_body``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from api.edge.budget import ByteBudget
from api.edge.errors import RETRY_HEADERS, send_edge_error
from api.types import ASGIApp, Message, Receive, Scope, Send

BODY_METHODS = ("POST", "PUT", "PATCH")
RELEASE_KEY = "tokcap.release_body"


class _Refused(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class BodyLimit:
    """Read the whole body within the limits above, then replay it to the app."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_inflight_bytes: int | None = None,
        body_timeout_s: float = 30.0,
        body_wait_s: float = 120.0,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = ByteBudget(max_inflight_bytes or 4 * max_bytes)
        self.body_timeout_s = body_timeout_s
        self.body_wait_s = body_wait_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        held = [0]  # bytes of this request taken from the budget

        def release() -> None:
            self.budget.give(held[0])
            held[0] = 0

        scope = {**scope, RELEASE_KEY: release}
        try:
            await self._wait_turn(scope, held)
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await self._read(receive, held)
            except TimeoutError:
                raise _Refused(
                    408, "request_timeout", f"request body not received in {self.body_timeout_s} s"
                ) from None
            if body is None:
                return  # the client went away before sending its body: nobody to answer
            replay = _replay(body, receive)
            del body  # the replay hands it over once, and nothing here keeps it after
            await self.app(scope, replay, send)
        except _Refused as refused:
            headers = RETRY_HEADERS if refused.status == 503 else None
            await send_edge_error(send, refused.status, refused.kind, refused.message, headers)
        finally:
            release()

    async def _wait_turn(self, scope: Scope, held: list[int]) -> None:
        """Take the declared size from the budget, in line if it must wait (module doc)."""
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if not declared.isdigit():
            return
        size = int(declared)
        self._check_size(size)  # refuse before reading a byte of it
        if not await self.budget.take(size, self.body_wait_s):
            raise _Refused(
                503,
                "overloaded_error",
                f"the server is at its limit of request bytes in flight and this request "
                f"waited {self.body_wait_s:g} s for room; retry shortly",
            )
        held[0] = size

    def _check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise _Refused(
                413,
                "request_too_large",
                f"request body exceeds the limit of {self.max_bytes} bytes",
            )

    def _grow(self, held: list[int], size: int) -> None:
        """A body longer than declared (or undeclared) takes more room, only if it is free
        now: waiting while holding part of a body could leave every reader waiting on all."""
        self._check_size(size)
        if not self.budget.grow(size - held[0]):
            raise _Refused(
                503,
                "overloaded_error",
                "the server is at its limit of request bytes in flight; retry shortly",
            )
        held[0] = size

    async def _read(self, receive: Receive, held: list[int]) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > held[0]:
                self._grow(held, size)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    held: list[bytes] = [body]  # handed over once, then let go: the call may wait long

    async def replay() -> Message:
        if not held:
            return await receive()  # after the body: disconnect notices come from here
        return {"type": "http.request", "body": held.pop(), "more_body": False}

    return replay


def release_body(scope: Scope) -> None:
    """The app has translated the body: it no longer counts as in flight (see above)."""
    release = scope.get(RELEASE_KEY)
    if callable(release):
        release()


async def take_body(request: Any) -> bytes:
    """The request body, read off the channel without the copy ``Request.body()`` keeps for
    the request's whole life (a call may wait minutes on the engine)."""
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
