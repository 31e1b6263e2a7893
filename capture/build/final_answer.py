"""The harness's final answer, reduced to a signature a call's output can be compared with.

The main chain is the one whose last call produced what the harness finally returned. The
harness may re-serialize that answer (whitespace, JSON key order), so both sides are reduced
to the same signature: the normalized text of the last assistant message, or the name and
canonical arguments of the last tool call, whichever comes last. Reasoning and tool results
do not count; they are not the answer. A whole reply (every text and tool call, in order)
reduces the same way to ``reply_digest``: a later request carries each earlier reply in its
history, and the digest names the call that sampled it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from capture.build.projection import chat_message_to_items, content_text, is_chat_message

Signature = tuple[str, ...]

_ANSWER_ROLES = (None, "assistant")


def normalize_text(text: str) -> str:
    """Collapse runs of whitespace, so a re-wrapped answer still matches."""
    return " ".join(text.split())


def canonical_arguments(arguments: Any) -> str:
    """Tool arguments as canonical JSON when they parse; the stripped string otherwise."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)


def item_signature(item: Any) -> Signature | None:
    """The signature of one Responses item, or None when it is not an answer."""
    if not isinstance(item, Mapping):
        return None
    kind = item.get("type")
    if kind == "message" and item.get("role") in _ANSWER_ROLES:
        text = normalize_text(content_text(item.get("content")))
        return ("text", text) if text else None
    if kind in ("output_text", "text"):
        text = normalize_text(str(item.get("text") or ""))
        return ("text", text) if text else None
    if kind == "function_call":
        return ("tool", str(item.get("name") or ""), canonical_arguments(item.get("arguments")))
    if kind == "tool_use":  # an Anthropic content block handed over as an item
        return ("tool", str(item.get("name") or ""), canonical_arguments(item.get("input")))
    return None


def answer_signature(answer: Any) -> Signature | None:
    """Signature of a final answer: a string, one item, or a list of output items."""
    if answer is None:
        return None
    if isinstance(answer, str):
        text = normalize_text(answer)
        return ("text", text) if text else None
    if isinstance(answer, Mapping):
        answer = [answer]
    if not isinstance(answer, (list, tuple)):
        return None
    for raw in reversed(answer):
        items = chat_message_to_items(raw) if is_chat_message(raw) else [raw]
        for item in reversed(items):
            signature = item_signature(item)
            if signature is not None:
                return signature
    return None


def reply_signature(reply: Any) -> tuple[Signature, ...]:
    """Every answer item of one reply, in order: a Chat message, or a call's output items."""
    if is_chat_message(reply):
        reply = chat_message_to_items(reply)
    if not isinstance(reply, (list, tuple)):
        return ()
    return tuple(s for s in map(item_signature, reply) if s is not None)


def reply_digest(reply: Any) -> str | None:
    """A short digest of ``reply_signature``; None for a reply with no text or tool call."""
    signature = reply_signature(reply)
    if not signature:
        return None
    return hashlib.blake2b(json.dumps(signature).encode(), digest_size=8).hexdigest()
