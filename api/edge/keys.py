"""``RequireKey``: with an auth secret, no model route without a key.

Runs outermost, before a body is read or counted: every path but the probes needs the
secret, or on a rollout's own paths that rollout's token (``capture.rollout_token``).
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from api.dialects import dialect_of
from api.edge.errors import error_response
from api.types import ASGIApp, Receive, Scope, Send
from capture.errors import InvalidRolloutIdError
from capture.rollout_ids import rollout_token, split_capture_path

# Paths (after the rollout prefix) that need no key: harnesses probe the base URL with HEAD,
# orchestrators ask /health and /ready, Prometheus scrapes /metrics. Every other path needs
# one, so a path spelled to slip past a list of guarded routes finds no way in.
OPEN_PATHS = frozenset({"/", "/v1", "/health", "/ready", "/metrics"})
KEY_REFUSED = (
    "missing or invalid API key: send the key as x-api-key or Authorization: Bearer "
    "(on a rollout's path, that rollout's token or the front end's secret)"
)


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
        # In the dialect the caller speaks, so its SDK raises its own auth error.
        dialect = dialect_of(rest, headers)
        refusal = error_response(dialect, 401, KEY_REFUSED, {"www-authenticate": "Bearer"})
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
