"""A faithful reply relayed as it is sampled: the renderer's parse of the ids so far, sent
only where it can no longer change.

Faithful prompts read a reply from its ids (``FaithfulPrompts.parsed_message``), so a
relayed stream shows the same parse, made of the ids sampled so far. A parse of a reply's
start is not always the start of the whole reply's parse: the renderer strips whitespace at
a region's ends, a character split across ids decodes as U+FFFD until its last byte comes,
and a tool call is text until it closes. So a parse only ever adds to what was sent: its
reasoning and text without whitespace at either end or a split character, reasoning only
before any text, and tool calls only at the end, from the whole reply's parse (with the ids
it names them by). What the whole parse adds to what was sent goes out last (``rest``); a
whole parse that does not continue what was sent fails the call (``RelayDiverged``), since
the harness must never keep text the capture does not hold.

Each parse reads every id so far, so the ids are parsed again only when they grew by an
eighth since the last parse or ``PARSE_EVERY_S`` passed: a reply of n ids costs about 8n
decoded ids, and a slow one a parse per ``PARSE_EVERY_S``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.engine.generation import UpstreamError
from api.prompts.faithful import RENDER_ERRORS, Prompt
from api.types import Delta

# Parse again once the events grew by 1/GROWTH since the last parse, or PARSE_EVERY_S passed.
GROWTH = 8
PARSE_EVERY_S = 0.2
DIVERGED = (
    "the reply's parse does not continue what its stream already showed the harness; "
    "nothing of it was captured: retry the request"
)


class RelayDiverged(UpstreamError):
    """The whole reply's parse does not continue the relayed text: a retryable 502."""

    def __init__(self) -> None:
        super().__init__(502, DIVERGED)


def settled(text: str) -> str:
    """What of a region's text so far no later id can change: no whitespace at its ends
    (the renderer strips it once the region closes), no split character at its end."""
    return text.strip().rstrip("\ufffd").rstrip()


@dataclass
class ParsedRelay:
    """What one faithful call's stream has sent so far, and when to parse again."""

    renderer: Any
    prompt: Prompt
    reasoning: str = ""  # sent so far
    text: str = ""
    held: bool = False  # a parse did not continue what was sent: nothing more until the end
    events: int = 0
    parsed_at: int = 0
    parsed_time: float = field(default_factory=time.monotonic)

    def due(self) -> bool:
        """Count one event of the stream; whether to parse the ids now."""
        self.events += 1
        grown = (self.events - self.parsed_at) * GROWTH >= self.events
        if self.held or not (grown or time.monotonic() - self.parsed_time >= PARSE_EVERY_S):
            return False
        self.parsed_at, self.parsed_time = self.events, time.monotonic()
        return True

    def advance(self, ids: list[int]) -> Delta:
        """What the parse of ``ids`` (every id sampled so far) adds to what was sent."""
        try:
            parsed = self.renderer.parse_response(
                ids, tools=self.prompt.tools, prompt_ids=self.prompt.ids
            )
        except RENDER_ERRORS:  # ids the checks will refuse: the end decides
            self.held = True
            return Delta()
        reasoning = settled(parsed.reasoning_content or "")
        text = settled(parsed.content or "")
        if not self._continues(reasoning, text):
            self.held = True
            return Delta()
        delta = Delta(reasoning[len(self.reasoning) :], text[len(self.text) :])
        self.reasoning, self.text = reasoning, text
        return delta

    def rest(self, message: Mapping[str, Any]) -> Delta:
        """What the whole reply's parse adds to what was sent, its tool calls last;
        ``RelayDiverged`` when it does not continue it."""
        reasoning = str(message.get("reasoning_content") or "")
        text = str(message.get("content") or "")
        if not self._continues(reasoning, text):
            raise RelayDiverged()
        calls = message.get("tool_calls") or []
        pieces = tuple(
            {
                "index": index,
                "id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
            for index, call in enumerate(calls)
        )
        return Delta(reasoning[len(self.reasoning) :], text[len(self.text) :], pieces)

    def _continues(self, reasoning: str, text: str) -> bool:
        """Whether ``reasoning`` and ``text`` extend what was sent, reasoning before text."""
        if not (reasoning.startswith(self.reasoning) and text.startswith(self.text)):
            return False
        return not (self.text and reasoning != self.reasoning)
