"""The prefix router: ``/ng-rollout/<id>/training-token-capture/<api path>`` is captured.

A small ASGI middleware in the starlette manner. It matches the path, works on a copy of the
scope with the prefix stripped (``path`` and ``raw_path`` both, so every later router sees
the plain API path), and opens the capture context of the call for tagged requests. The body
is passed through untouched. ``/ng-rollout/<id>/<api path>`` without the capture segment is
served but not captured; an invalid id is answered with a 400 that names the rule, never
rewritten (a rewritten id would merge or split rollouts).

``RequireKey`` runs before both (and before a body is read): with an auth secret, every path
but the probes needs the secret, or on a rollout's own paths that rollout's token.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from api.dialects import anthropic, chat, responses
from api.edge.body import send_error
from api.types import ASGIApp, Receive, Scope, Send
from capture.context import DEFAULT_CAPTURE_TIMEOUT_S, capture_call
from capture.errors import InvalidRolloutIdError
from capture.protocols import TokenSink
from capture.rollout_ids import rollout_token, split_capture_path, validate_rollout_id

# Paths (after the rollout prefix) that need no key: harnesses probe the base URL with HEAD,
# orchestrators ask /health and /ready, Prometheus scrapes /metrics. Every other path needs
# one, so a path spelled to slip past a list of guarded routes finds no way in.
OPEN_PATHS = frozenset({"/", "/v1", "/health", "/ready", "/metrics"})
KEY_REFUSED = (
    "missing or invalid API key: send the key as x-api-key or Authorization: Bearer "
    "(on a rollout's path, that rollout's token or the front end's secret)"
)


@dataclass
class SinkSlot:
    """The one place a worker's sink lives: empty until its lifespan built it, then read
    by the router for every captured call."""

    sink: TokenSink | None = None


def _strip_raw_path(raw_path: bytes | None, path: str, rest: str) -> bytes:
    """The raw path without the prefix; re-encoded when the client escaped the prefix."""
    prefix = path[: len(path) - len(rest)] if path.endswith(rest) else ""
    if raw_path is not None and prefix and raw_path.startswith(prefix.encode()):
        stripped = raw_path[len(prefix.encode()) :]
        return stripped if stripped.startswith(b"/") else b"/" + stripped
    return rest.encode()


class CapturePrefixRouter:
    """Strip the rollout prefix and open a capture context for the captured form."""

    def __init__(
        self,
        app: ASGIApp,
        slot: SinkSlot,
        capture_timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.slot = slot
        self.capture_timeout_s = capture_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        rollout_id, captured, rest = split_capture_path(path)
        if rollout_id is None:
            await self.app(scope, receive, send)
            return
        try:
            validate_rollout_id(rollout_id)
        except InvalidRolloutIdError as exc:
            await send_error(
                send, 400, "invalid_request_error", f"invalid rollout id in the URL: {exc}"
            )
            return
        scope = dict(scope)
        scope["raw_path"] = _strip_raw_path(scope.get("raw_path"), path, rest)
        scope["path"] = rest
        scope["tokcap_rollout_id"] = rollout_id
        sink = self.slot.sink if captured else None
        if sink is None:
            await self.app(scope, receive, send)
            return
        async with capture_call(rollout_id, sink, timeout_s=self.capture_timeout_s):
            await self.app(scope, receive, send)


def _error_body(path: str, headers: Headers) -> Callable[[int, str], dict[str, Any]]:
    """The 401 in the dialect the caller speaks, so its SDK raises its own auth error."""
    if path.startswith("/v1/messages") or "anthropic-version" in headers:
        return anthropic.error_body
    if path.startswith("/v1/responses"):
        return responses.error_body
    return chat.error_body


def _presented_keys(headers: Headers) -> list[bytes]:
    """The keys harnesses send: ``x-api-key`` (Anthropic SDKs), ``Authorization: Bearer``."""
    keys = [headers["x-api-key"]] if "x-api-key" in headers else []
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        keys.append(credentials.strip())
    return [key.encode("latin-1") for key in keys if key]


class RequireKey:
    """Answer 401 to a request off the open paths with neither the secret nor its rollout's token.

    The expected keys are computed per request (one HMAC); every presented key is compared
    with each in constant time. A rollout token opens only its own rollout's paths, captured
    or not; the secret opens every path (the collector's own calls). No key is ever echoed.
    """

    def __init__(self, app: ASGIApp, secret: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._secret = secret
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rollout_id, _, rest = split_capture_path(scope["path"])
        if rest in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self._accepts(_presented_keys(headers), rollout_id):
            await self.app(scope, receive, send)
            return
        body = _error_body(rest, headers)(401, KEY_REFUSED)
        refusal = JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
        await refusal(scope, receive, send)

    def _accepts(self, presented: list[bytes], rollout_id: str | None) -> bool:
        expected = [self._secret.encode()]
        if rollout_id is not None:
            try:
                expected.append(rollout_token(self._secret, rollout_id).encode())
            except InvalidRolloutIdError:
                pass  # no token names an invalid id; the secret may still pass (then a 400)
        # Every comparison runs, so the time taken says nothing about which key came close.
        matches = [hmac.compare_digest(key, want) for key in presented for want in expected]
        return any(matches)
