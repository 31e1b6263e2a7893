"""Split generated text into reasoning, content and Hermes ``<tool_call>`` calls.

Keeps the character spans of each part, so a stream can hand out exactly the pieces the
non-streamed reply holds (concatenated deltas equal the final fields). Like vLLM's hermes
parser: if any call fails to parse, no calls are reported and the text stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments
    end: int  # offset just past this call's closing tag

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ParsedCall] = field(default_factory=list)
    reasoning_span: tuple[int, int] = (0, 0)
    content_span: tuple[int, int] = (0, 0)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _stripped(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def parse_reply(text: str, *, parse_tools: bool = True) -> ParsedReply:
    reasoning = None
    reasoning_span = (0, 0)
    body_start = 0
    lead = len(text) - len(text.lstrip())
    if text.startswith(THINK_OPEN, lead):
        open_end = lead + len(THINK_OPEN)
        close = text.find(THINK_CLOSE, open_end)
        think_end = close if close >= 0 else len(text)
        reasoning_span = _stripped(text, open_end, think_end)
        reasoning = text[reasoning_span[0] : reasoning_span[1]]
        body_start = close + len(THINK_CLOSE) if close >= 0 else len(text)

    calls: list[ParsedCall] = []
    content_end = len(text)
    first = text.find(CALL_OPEN, body_start) if parse_tools else -1
    if first >= 0:
        try:
            for match in _CALL.finditer(text, body_start):
                obj = json.loads(match.group(1))
                arguments = obj.get("arguments", {})
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                calls.append(ParsedCall(new_call_id(), str(obj["name"]), arguments, match.end()))
        except (ValueError, KeyError, TypeError, AttributeError):
            calls = []
        if calls:
            content_end = first
    content_span = _stripped(text, body_start, content_end)
    content = text[content_span[0] : content_span[1]] or None
    return ParsedReply(reasoning, content, calls, reasoning_span, content_span)
