"""Output items in one shape: a Chat message as Responses items, and the text of content.

A call's output is stored as Responses items; a harness's history and final answer may hold
Chat messages. Both the front end (reading a request's history) and the rebuild (projecting
and matching chains) turn one into the other here, the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Content part types whose ``text`` is what the model wrote (or, for input parts, was shown).
_TEXT_PARTS = ("output_text", "text", "input_text")


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") in _TEXT_PARTS:
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
    return "".join(texts)


def _arguments(value: Any) -> str:
    # Compact, as the rebuilt items have always carried them (a dialect's own JSON text,
    # api.dialects.common.arguments_text, is what the harness was served).
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, separators=(",", ":"))


def is_chat_message(item: Any) -> bool:
    """A Chat-completions message (``role``/``content``/``tool_calls``, no ``type``)."""
    return (
        isinstance(item, Mapping)
        and "type" not in item
        and ("role" in item or "content" in item or "tool_calls" in item)
    )


def chat_message_to_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One Chat message as Responses items: reasoning, message text, function calls.

    Always returns at least one item, so a message with no content can still carry tokens.
    """
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        items.append(
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
            }
        )
    text = content_text(message.get("content"))
    if text:
        items.append(message_item(text, message.get("role") or "assistant"))
    calls = message.get("tool_calls") or []
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping):
        calls = [*calls, {"id": "", "function": legacy}]
    for call in calls:
        if not isinstance(call, Mapping):
            continue
        function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        items.append(
            {
                "type": "function_call",
                "call_id": str(call.get("id") or ""),
                "name": str(function.get("name") or ""),
                "arguments": _arguments(function.get("arguments")),
                "status": "completed",
            }
        )
    if not items or all(item["type"] == "reasoning" for item in items):
        items.append(message_item("", message.get("role") or "assistant"))
    return items


def message_item(text: str, role: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
