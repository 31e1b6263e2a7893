"""What makes one wire dialect: the interface each dialect module implements.

A dialect module owns its whole wire format, and the call room (``api.call``) reads it only
through this protocol: ``to_chat`` turns its request into one chat-completions request,
``reply`` turns a served call into its reply, ``opening``/``events``/``Relay`` make its
server-sent events (replayed from a finished reply, or relayed delta by delta), and
``error_body``/``stream_error`` shape its errors. A module satisfies it structurally, as
starlette's modules satisfy ASGI: nobody inherits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from api.types import Delta, ServedCall


class Relay(Protocol):
    """A reply relayed as the engine samples it: each delta's events, then the ending."""

    def delta(self, delta: Delta) -> list[bytes]: ...

    def close(self, reply: Mapping[str, Any]) -> list[bytes]: ...


class Dialect(Protocol):
    """One wire dialect (``api.dialects.anthropic``, ``chat``, ``responses``)."""

    NAME: str
    PATH: str  # the route it is served on
    REQUEST_SCHEMA: dict[str, Any]  # what the OpenAPI document names of its requests
    KEEPALIVE: bytes  # what its stream sends while nothing else is
    Relay: Callable[[Mapping[str, Any], Mapping[str, Any]], Relay]

    def to_chat(self, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def reply_head(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The reply's identity, fixed before the engine answers (a stream opens with it)."""
        ...

    def reply(
        self, captured: ServedCall, body: Mapping[str, Any], head: Mapping[str, Any] | None = None
    ) -> dict[str, Any]: ...

    def opening(self, head: Mapping[str, Any], body: Mapping[str, Any]) -> list[bytes]:
        """What a stream sends before the reply is known."""
        ...

    def events(
        self, reply: Mapping[str, Any], body: Mapping[str, Any], opened: bool
    ) -> list[bytes]:
        """A finished reply's events, the final one last (without the opening ones when the
        stream ``opened`` already)."""
        ...

    def stream_error(
        self, head: Mapping[str, Any], body: Mapping[str, Any], status: int, message: str, sent: int
    ) -> bytes:
        """The event that ends a stream whose reply cannot be served (``sent`` events before)."""
        ...

    def error_body(self, status: int, message: str) -> dict[str, Any]: ...
