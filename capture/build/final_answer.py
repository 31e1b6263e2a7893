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

from collections.abc import Mapping
from typing import Any

from capture.items import chat_message_to_items, is_chat_message
from capture.traits import Signature, item_signature, normalize_text


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
