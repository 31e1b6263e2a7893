"""What a client may send: bounded bodies, bounded bytes in flight, bounded time.

Anything a client sends gets a clear 4xx (or a retryable 503 when the server is merely
busy), never a 500 or a memory blow-up. ``BodyLimit`` reads each request body before the
app sees it: beyond ``max_body_bytes`` it answers 413; when the bodies being read and
parsed would pass ``max_inflight_bytes`` it answers 503, because parsing turns every body
byte into several bytes of Python objects; a body that has not arrived after
``body_timeout_s`` is cut with a 408. A body counts until the app has translated it and
calls ``release_body`` (``RELEASE_KEY`` in the scope), not while the call waits on the
engine: by then what the call holds is the request it sent, about the body's size, and
the engine, not this guard, decides how many calls wait at once. The body is then parsed
by ``api.edge.json_body``.
"""

from __future__ import annotations

import asyncio
from typing import Any

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
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes or 4 * max_bytes
        self.body_timeout_s = body_timeout_s
        self.inflight_bytes = 0  # bodies of requests being read or served, this process

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        held = [0]  # bytes of this request counted in inflight_bytes

        def release() -> None:
            self.inflight_bytes -= held[0]
            held[0] = 0

        scope = {**scope, RELEASE_KEY: release}
        try:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await self._read(scope, receive, held)
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

    def _hold(self, held: list[int], size: int) -> None:
        if size > self.max_bytes:
            raise _Refused(
                413,
                "request_too_large",
                f"request body exceeds the limit of {self.max_bytes} bytes",
            )
        if self.inflight_bytes + size - held[0] > self.max_inflight_bytes:
            raise _Refused(
                503,
                "overloaded_error",
                "the server is at its limit of request bytes in flight; retry shortly",
            )
        self.inflight_bytes += size - held[0]
        held[0] = size

    async def _read(self, scope: Scope, receive: Receive, held: list[int]) -> bytes | None:
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit():
            self._hold(held, int(declared))  # refuse before reading a byte of it
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > held[0]:
                self._hold(held, size)
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
