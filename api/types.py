"""Types that cross the front end's rooms, gathered as starlette does: ASGI aliases, the
delta a relayed stream carries from the engine room to a dialect, and a served call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from capture.records import TokenEntry

if TYPE_CHECKING:  # the engine room imports this module: no import back at run time
    from api.engine.generation import Generation

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Delta:
    """What one piece of a streamed reply adds to what the harness sees, whatever engine
    sampled it: a dialect's relay turns it into its own events."""

    reasoning: str = ""
    text: str = ""
    # Tool-call pieces: {"index", "id", "name", "arguments"}; id and name on a call's first.
    tool_calls: tuple[dict[str, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.text or self.tool_calls)


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
