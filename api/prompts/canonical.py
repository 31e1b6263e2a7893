"""A conversation named by what was said in it, whatever the wire did to its form.

A harness echoes the history it was served, but rarely byte for byte: tool-call arguments
come back re-serialized (other spacing, other key order, objects instead of text), text
loses or gains edge whitespace, a turn's reasoning is dropped (OpenAI chat clients have no
field for it), one assistant turn arrives as several messages (Responses items). The
canonical form keeps what identifies the conversation: roles, text and reasoning with edge
whitespace stripped, tool names, tool-call ids, arguments as parsed JSON, tool results and
the tool set; consecutive assistant messages are one turn. A lineage key is a digest of it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from capture.build.projection import content_text

KEY_BYTES = 16


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except ValueError:
            return value.strip()
    return value if value is not None else {}


def _calls(message: Mapping[str, Any]) -> list[list[Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function if isinstance(function, Mapping) else {}
        calls.append(
            [
                str(call.get("id") or ""),
                str(function.get("name") or ""),
                _arguments(function.get("arguments")),
            ]
        )
    return calls


def _turn(message: Mapping[str, Any], reasoning: bool) -> dict[str, Any]:
    role = str(message.get("role") or "")
    turn: dict[str, Any] = {"role": role, "text": content_text(message.get("content")).strip()}
    if role == "assistant":
        thought = message.get("reasoning_content") or message.get("reasoning") or ""
        turn["reasoning"] = content_text(thought).strip() if reasoning else ""
        turn["calls"] = _calls(message)
    elif role == "tool":
        turn["call_id"] = str(message.get("tool_call_id") or "")
    return turn


def canonical_turns(messages: Sequence[Mapping[str, Any]], reasoning: bool) -> list[dict]:
    """The turns of a conversation; consecutive assistant messages merged into one."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        turn = _turn(message, reasoning)
        last = turns[-1] if turns else None
        if turn["role"] == "assistant" and last is not None and last["role"] == "assistant":
            last["text"] = (last["text"] + turn["text"]).strip()
            last["reasoning"] = (last["reasoning"] + turn["reasoning"]).strip()
            last["calls"] += turn["calls"]
        else:
            turns.append(turn)
    return turns


def lineage_key(
    messages: Sequence[Mapping[str, Any]], tools: Any, *, reasoning: bool = True
) -> str:
    """The digest of a conversation and its tool set; ``reasoning=False`` leaves thinking out."""
    document = {"tools": tools or [], "turns": canonical_turns(messages, reasoning)}
    data = json.dumps(document, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(data.encode(), digest_size=KEY_BYTES).hexdigest()


def lineage_keys(messages: Sequence[Mapping[str, Any]], tools: Any) -> list[str]:
    """The keys a conversation is found by: with its reasoning, and without (if it has any)."""
    keys = [lineage_key(messages, tools)]
    bare = lineage_key(messages, tools, reasoning=False)
    return keys if bare == keys[0] else [*keys, bare]


def split_history(messages: Sequence[Mapping[str, Any]]) -> tuple[list, list]:
    """(history through the last assistant turn, the messages after it); ([], all) if none."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            return list(messages[: index + 1]), list(messages[index + 1 :])
    return [], list(messages)
