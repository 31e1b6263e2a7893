"""Types the front end's modules share, gathered as starlette does: ASGI aliases, a call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from api.generation import Generation
from capture.records import TokenEntry

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# "captured"; "incomplete" (its loss is recorded); "unrecorded" (neither the entry nor its
# loss became durable: the harness must not get the reply); "uncaptured" (no capture
# context: an untagged path).
CaptureOutcome = Literal["captured", "incomplete", "unrecorded", "uncaptured"]


@dataclass(frozen=True)
class CapturedCall:
    """A completion, the items served for it, and the outcome of its capture."""

    generation: Generation
    items: list[dict[str, Any]]
    entry: TokenEntry | None
    outcome: CaptureOutcome
    put_seconds: float = 0.0
