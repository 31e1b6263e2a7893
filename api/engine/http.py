"""HTTP to the engine: one keep-alive connection pool per worker, on aiohttp.

Every model call is one POST of a JSON body (70 KB at a 16k-token prompt) and one reply
(100 KB with the prompt's ids). aiohttp's client spends about a fifth of httpx's CPU on
such a round trip (0.23 ms against 1.2 ms on loopback, bench/bench_frontend.py), and the
front end's time per call is mostly CPU. The session is made on first use, inside the
worker's event loop, as aiohttp requires. ``trust_env`` stays off: an engine is reached
directly, never through a proxy from the environment.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import aiohttp
from yarl import URL

from api import jsonbytes
from api.engine.generation import UpstreamError

JSON_HEADERS = {"content-type": "application/json"}
# The rollout of the call being served (set by ``api.call.work``), sent as the affinity key
# a router in front of the engines reads, so that it keeps a rollout on one engine: smg's
# (the Shepherd Model Gateway, 1.13) ``consistent_hashing`` and ``manual`` policies read
# X-SMG-Routing-Key, vllm-router's (0.1.17) ``consistent_hash`` policy X-Session-ID first.
ROUTING_KEY: ContextVar[str | None] = ContextVar("tokcap_routing_key", default=None)
ROUTING_HEADERS = ("x-smg-routing-key", "x-session-id")


def _headers() -> dict[str, str]:
    key = ROUTING_KEY.get()
    if key is None:
        return JSON_HEADERS
    return {**JSON_HEADERS, **dict.fromkeys(ROUTING_HEADERS, key)}


# uvicorn, which serves vLLM and SGLang, closes a connection idle for 5 s; a pooled one kept
# as long can be closed just as a request goes out on it. Expire ours well before that.
KEEPALIVE_EXPIRY_S = 2.0
# Start-up questions (/version, /v1/models) are trivial to serve: a slow answer must not
# hold the first call for long.
QUESTION_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=30.0)

# What "the engine could not be reached or did not answer" looks like to the client.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class EngineHTTP:
    """POSTs and GETs against one base URL, with the auth header every request carries."""

    def __init__(
        self, base_url: str, *, headers: dict[str, str], timeout_s: float, connections: int = 0
    ) -> None:
        self.base_url = base_url
        # Concurrent calls reuse warm connections; 0 opens as many as there are calls, so
        # the engine, not this pool, decides how many it serves at once.
        self._connections = connections
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._connections, keepalive_timeout=KEEPALIVE_EXPIRY_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=self._timeout,
            )
        return self._session

    async def post(self, path: str, content: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST; a pooled connection the engine closed as the request
        went out, with no answer, is tried once more on a fresh one, and so is a connection
        that was not made in time (nothing was sent: a worker whose event loop was starved
        for ``sock_connect`` seconds on a busy host sees its own timer fire first), or was
        reset before an answer (an engine's listen queue overflowing when 1,000 calls open
        connections at once: the kernel resets what it accepted but could not queue)."""
        try:
            return await self._post_once(path, content)
        except aiohttp.ClientError as exc:
            if not _unanswered(exc):
                raise
            # Nothing was answered, so a sample the engine may have drawn never reached the
            # harness or the capture.
            return await self._post_once(path, content)

    async def _post_once(self, path: str, content: bytes) -> tuple[int, bytes]:
        session = self._open()
        async with session.post(self._url(path), data=content, headers=_headers()) as reply:
            return reply.status, await reply.read()

    @asynccontextmanager
    async def stream(self, path: str, content: bytes) -> AsyncIterator[aiohttp.ClientResponse]:
        """One POST whose reply is read as it arrives (``reply.content``, line by line).

        Leaving the block before the reply ended closes the connection: that is how an
        engine is told to abort the request (vLLM and SGLang both listen for it).
        """
        session = self._open()
        async with session.post(self._url(path), data=content, headers=_headers()) as reply:
            try:
                yield reply
            except BaseException:
                reply.close()  # never back to the pool half-read: the engine sees it go
                raise

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of a start-up question, under its short timeout."""
        session = self._open()
        async with session.get(self._url(path), timeout=QUESTION_TIMEOUT) as reply:
            return reply.status, await reply.read()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _unanswered(exc: aiohttp.ClientError) -> bool:
    """Whether a POST failed before any answer in a way a fresh connection may not (see
    ``EngineHTTP.post``)."""
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError)):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno == errno.ECONNRESET


def sse_data(line: bytes) -> str | None:
    """The payload of one SSE ``data:`` line of an engine's stream; None for anything else
    (comments, blanks)."""
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    return text[len("data:") :].strip()


def sse_chunk(data: str) -> Any:
    """One stream chunk; an error object the engine sent mid-stream ends the call (502)."""
    try:
        chunk = jsonbytes.loads(data)
    except ValueError as exc:
        raise UpstreamError(502, "upstream sent a stream chunk that is not JSON") from exc
    if isinstance(chunk, Mapping) and chunk.get("error"):
        error = chunk["error"]
        message = error.get("message") if isinstance(error, Mapping) else error
        raise UpstreamError(502, f"upstream stream failed: {message}")
    return chunk
