"""The engine's ``--api-key``: a bearer key, checked on the paths its engine checks.

vLLM 0.10.2 checks only paths under ``/v1`` (``api_server.py``, ``AuthenticationMiddleware``);
SGLang checks every path but ``/health*`` and ``/metrics*`` (``utils/auth.py``). Both let
OPTIONS through and answer a missing or wrong key with 401 ``{"error": "Unauthorized"}``.
The key is compared in constant time and never written to a log or a reply.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str, guarded: Callable[[str], bool]) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()
        self._guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._lets_through(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse({"error": "Unauthorized"}, status_code=401)
        await response(scope, receive, send)

    def _lets_through(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return True
        if not self._guarded(scope["path"]):
            return True
        given = Headers(scope=scope).get("authorization", "").encode()
        return hmac.compare_digest(given, self._expected)
