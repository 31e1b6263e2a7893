"""Types the front end's modules share, gathered as starlette does: ASGI aliases, a call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from api.engine.generation import Generation
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
class ServedCall:
    """A completion as served: the items the harness gets and how its capture ended (the
    running state of a capture is ``capture.context.CallCapture``)."""

    generation: Generation
    items: list[dict[str, Any]]
    entry: TokenEntry | None
    outcome: CaptureOutcome
    put_seconds: float = 0.0
