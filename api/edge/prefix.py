"""The prefix router: ``/ng-rollout/<id>/training-token-capture/<api path>`` is captured.

A small ASGI middleware in the starlette manner. It matches the path, works on a copy of the
scope with the prefix stripped (``path`` and ``raw_path`` both, so every later router sees
the plain API path), and opens the capture context of the call for tagged requests. The body
is passed through untouched. ``/ng-rollout/<id>/<api path>`` without the capture segment is
served but not captured; an invalid id is answered with a 400 that names the rule, never
rewritten (a rewritten id would merge or split rollouts).

``api.edge.keys.RequireKey`` runs before it (and before a body is read).
"""

from __future__ import annotations

from dataclasses import dataclass

from api.edge.errors import send_edge_error
from api.types import ASGIApp, Receive, Scope, Send
from capture.context import DEFAULT_CAPTURE_TIMEOUT_S, capture_call
from capture.errors import InvalidRolloutIdError
from capture.protocols import TokenSink
from capture.rollout_ids import split_capture_path, validate_rollout_id


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
            await send_edge_error(
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
