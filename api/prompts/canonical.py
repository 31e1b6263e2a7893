"""A conversation named by what was said in it, whatever the wire did to its form.

A harness echoes the history it was served, but rarely byte for byte: tool-call arguments
come back re-serialized (other spacing, other key order, objects instead of text), text
loses or gains edge whitespace, a turn's reasoning is dropped (OpenAI chat clients have no
field for it), one assistant turn arrives as several messages (Responses items). The
canonical form keeps what identifies the conversation: roles, text and reasoning with edge
whitespace stripped, tool names, tool-call ids, arguments as parsed JSON, tool results and
the tool set; consecutive assistant messages are one turn.

A lineage key is the digest of the tool set and the canonical turns' digests, one stream:
one pass over a request gives the key of its history (a copy of the hash state at the last
assistant turn) and the state the reply's key continues from. Each turn is serialized with
sorted keys by orjson (json for what orjson cannot hold, such as integers beyond 64 bits),
the same way in every worker.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from capture.items import content_text

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


def _turn(message: Mapping[str, Any]) -> dict[str, Any]:
    role = str(message.get("role") or "")
    turn: dict[str, Any] = {"role": role, "text": content_text(message.get("content")).strip()}
    if role == "assistant":
        thought = message.get("reasoning_content") or message.get("reasoning") or ""
        turn["reasoning"] = content_text(thought).strip()
        turn["calls"] = _calls(message)
    elif role == "tool":
        turn["call_id"] = str(message.get("tool_call_id") or "")
    return turn


def _merged(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive assistant messages as the one turn they are."""
    return {
        **first,
        "text": (first["text"] + second["text"]).strip(),
        "reasoning": (first["reasoning"] + second["reasoning"]).strip(),
        "calls": first["calls"] + second["calls"],
    }


def canonical_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The turns of a conversation; consecutive assistant messages merged into one."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        turn = _turn(message)
        if turn["role"] == "assistant" and turns and turns[-1]["role"] == "assistant":
            turns[-1] = _merged(turns[-1], turn)
        else:
            turns.append(turn)
    return turns


def _bare(turn: dict[str, Any]) -> dict[str, Any]:
    """The turn as a harness that drops reasoning sends it back."""
    return {**turn, "reasoning": ""} if turn.get("reasoning") else turn


def _serialized(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # beyond orjson (say, a 70-bit integer)
        return json.dumps(value, sort_keys=True, ensure_ascii=False).encode()


def _names(full: Any, bare: Any) -> list[str]:
    """The keys of the turns hashed so far: with reasoning, then without if it differs."""
    keys = [full.copy().hexdigest(), bare.copy().hexdigest()]
    return keys[:1] if keys[0] == keys[1] else keys


@dataclass(frozen=True)
class Lineage:
    """A conversation's canonical turns, hashed as one stream (after the tool set) with its
    reasoning and without, and the keys of its history through the last assistant turn."""

    turns: list[dict[str, Any]]
    tools: Any
    full: Any  # blake2b state after every turn
    bare: Any  # the same, reasoning left out
    history: list[str]

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, Any]], tools: Any) -> Lineage:
        return cls.of_turns(canonical_turns(messages), tools)

    @classmethod
    def of_turns(cls, turns: list[dict[str, Any]], tools: Any) -> Lineage:
        full = hashlib.blake2b(b"tokcap-lineage-1", digest_size=KEY_BYTES)
        full.update(_serialized(tools or []))
        bare = full.copy()
        last_assistant = max(
            (i for i, turn in enumerate(turns) if turn["role"] == "assistant"), default=-1
        )
        history: list[str] = []
        for index, turn in enumerate(turns):
            _hash(full, bare, turn)
            if index == last_assistant:
                history = _names(full, bare)
        return cls(turns, tools, full, bare, history)

    def with_reply(self, reply: Mapping[str, Any]) -> Lineage:
        """This conversation followed by ``reply``, merged into a trailing assistant turn
        as the harness's next request will show it; hashes only the reply."""
        turn = _turn(reply)
        if self.turns and self.turns[-1]["role"] == "assistant":  # a prefilled reply: rare
            return Lineage.of_turns([*self.turns[:-1], _merged(self.turns[-1], turn)], self.tools)
        full, bare = self.full.copy(), self.bare.copy()
        _hash(full, bare, turn)
        return Lineage([*self.turns, turn], self.tools, full, bare, _names(full, bare))

    def all_names(self) -> list[str]:
        """The keys of the whole conversation."""
        return _names(self.full, self.bare)


def _digest(turn: dict[str, Any]) -> bytes:
    return hashlib.blake2b(_serialized(turn), digest_size=KEY_BYTES).digest()


def _hash(full: Any, bare: Any, turn: dict[str, Any]) -> None:
    """Add one turn to both streams: its digest, so its text is hashed once, not twice."""
    digest = _digest(turn)
    full.update(digest)
    bare.update(_digest(_bare(turn)) if turn.get("reasoning") else digest)


def lineage_key(
    messages: Sequence[Mapping[str, Any]], tools: Any, *, reasoning: bool = True
) -> str:
    """The key of a whole conversation; ``reasoning=False`` leaves thinking out."""
    lineage = Lineage.of(messages, tools)
    return (lineage.full if reasoning else lineage.bare).copy().hexdigest()


def lineage_keys(messages: Sequence[Mapping[str, Any]], tools: Any) -> list[str]:
    """The keys a conversation is found by: with its reasoning, and without (if it has any)."""
    return Lineage.of(messages, tools).all_names()


def split_history(messages: Sequence[Mapping[str, Any]]) -> tuple[list, list]:
    """(history through the last assistant turn, the messages after it); ([], all) if none."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            return list(messages[: index + 1]), list(messages[index + 1 :])
    return [], list(messages)
