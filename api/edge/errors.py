"""The one error map: every error the front end answers is shaped here.

A route or middleware says what went wrong (a status and a message, or an exception a
client's request raised); this module answers it in the shape the caller reads. A model
call's error takes its dialect's shape (``Dialect.error_body``), so its SDK raises its own
error type: Anthropic's ``overloaded_error`` for a 503, which the Claude Code CLI retries.
An error the edge answers before the body is read (too large, too slow, an invalid rollout
id) has one body both SDK families read. The trainer's routes answer ``{"error": ...}``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from api.dialects.common import RequestError
from api.dialects.dialect import Dialect
from api.types import Send

# What a client is told to do with a 503: retry soon (Anthropic and OpenAI SDKs read these).
RETRY_HEADERS = {"retry-after": "1", "x-should-retry": "true"}
# nginx's status for a request whose client closed the connection first; nobody reads it.
CLIENT_CLOSED_REQUEST = 499
# What a request a client sent may raise while it is parsed and translated: each is a 400.
BAD_REQUEST_ERRORS = (RequestError, TypeError, ValueError, KeyError, AttributeError, RecursionError)
UNAVAILABLE = (
    "the token capture store could not record this call in time; the reply was withheld "
    "so the rollout stays exact: retry the request"
)


def bad_request_message(exc: BaseException) -> str:
    """What a 400 says of a request that raised one of ``BAD_REQUEST_ERRORS``."""
    return "request nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def error_response(
    dialect: Dialect, status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error in the dialect's shape; a 503 tells the client to retry."""
    if status == 503 and headers is None:
        headers = RETRY_HEADERS
    return JSONResponse(dialect.error_body(status, message), status_code=status, headers=headers)


def bad_request(dialect: Dialect, exc: BaseException) -> JSONResponse:
    return error_response(dialect, 400, bad_request_message(exc))


def plain_error(status: int, message: str) -> JSONResponse:
    """An error of the trainer's routes: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status)


def edge_error_bytes(kind: str, message: str) -> bytes:
    """An error body both SDKs read: Anthropic reads error.type, OpenAI error.message."""
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


async def send_edge_error(
    send: Send, status: int, kind: str, message: str, headers: dict[str, Any] | None = None
) -> None:
    """Answer an error from an ASGI middleware, before any route ran."""
    body = edge_error_bytes(kind, message)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
