"""What a request says about its place in a rollout: the traits an entry records.

The front end reads them off each request, where the request is whole (``api.call.traits``),
and stores them in the entry's ``request_traits`` field (``capture.records.TRAITS_FIELD``);
the rebuild reads them back to label segments and explain roots (``capture.build``). The
keys and the digests are defined here, once, so writer and reader compute them the same
way: line digests of a conversation's opening message, and the digest of a whole reply.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from capture.items import chat_message_to_items, content_text, is_chat_message
from capture.records import TRAITS_FIELD, TokenEntry

Signature = tuple[str, ...]

_ANSWER_ROLES = (None, "assistant")

TURNS_BEFORE = "turns_before"  # assistant turns the request carried
ANSWERED_BEFORE = "answered_before"  # reply_digest of the last of them, or None
OPENING = "opening"  # line digests of the first user message (conversation starts only)
# Enough for an opening message with a long instruction file in it; the entry stays small
# (256 x 12 hex digits), since only a conversation's first call records them.
MAX_OPENING_LINES = 256
# Lines shorter than this say too little to relate two conversations ("Done.", "dir-3").
MIN_LINE_CHARS = 16
TAG = re.compile(r"</?[A-Za-z][\w.-]*(?:\s[^<>]*)?/?>")


# A long message is split into lines a piece at a time (this many characters, then twice
# as many each time), so a reader that needs only its first lines never splits the rest.
FIRST_PIECE_CHARS = 8192


def _lines(text: str) -> Iterator[str]:
    """``text.splitlines()``, a piece at a time. Each piece ends just after a newline (a
    CR LF pair stays whole), so the pieces' lines are exactly the text's."""
    start, size = 0, FIRST_PIECE_CHARS
    while start < len(text):
        cut = text.find("\n", start + size)
        end = len(text) if cut < 0 else cut + 1
        yield from text[start:end].splitlines()
        start, size = end, size * 2


def _words(line: str) -> str:
    """``" ".join(line.split())``: runs of whitespace as one space, none at the ends.

    Most lines have nothing to collapse, and the test for that is cheaper than the split:
    within a line from ``splitlines``, the only ASCII whitespace left is the space, the tab
    and the unit separator, so an ASCII line without a tab, a unit separator, a double
    space or a space at an end is its own result.
    """
    if (
        line.isascii()
        and "  " not in line
        and "\t" not in line
        and "\x1f" not in line
        and line[:1] != " "
        and line[-1:] != " "
    ):
        return line
    return " ".join(line.split())


def _digests(text: str) -> Iterator[str]:
    """One short digest per line worth comparing, markup tags and spacing aside; read line
    by line, so a reader that needs only the first few stops early."""
    empty = hashlib.blake2b(digest_size=6)  # copied per line: cheaper than a new hasher
    for raw in _lines(text):
        if len(raw) < MIN_LINE_CHARS:
            continue  # too short for any line in it to count
        for line in TAG.sub("\n", raw).splitlines() if "<" in raw else (raw,):
            words = _words(line)
            if len(words) >= MIN_LINE_CHARS:
                hasher = empty.copy()
                hasher.update(words.encode())
                yield hasher.hexdigest()


def line_digests(text: str) -> list[str]:
    return list(_digests(text))


def opening_digests(text: str) -> list[str]:
    """The line digests a conversation start records of its first user message: the first
    ``MAX_OPENING_LINES`` distinct ones (the rest of a long message is not read)."""
    found: dict[str, None] = {}
    for digest in _digests(text):
        found[digest] = None
        if len(found) == MAX_OPENING_LINES:
            break
    return list(found)


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


def traits(entry: TokenEntry) -> dict[str, Any]:
    """The request traits an entry recorded ({} for an entry without them)."""
    found = (entry.model_extra or {}).get(TRAITS_FIELD)
    return found if isinstance(found, dict) else {}


def is_side_request(found: Mapping[str, Any]) -> bool:
    """A request of the shape harnesses send beside their loop: a title (a JSON-schema
    answer with no tools), from its traits."""
    return bool(found.get("structured_output")) and not found.get("n_tools")
