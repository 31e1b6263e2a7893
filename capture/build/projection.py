"""Project a chain of calls onto contiguous, token-bearing Responses output items.

Each call on the delivered chain contributes its own output items, in order. The item that
carried the call's token arrays when it was served (``token_item_index``) carries them again:
``prompt_token_ids`` is the running sequence so far (that call's whole prompt),
``generation_token_ids`` and ``generation_log_probs`` what it sampled. Content (text, tool
calls) is kept. Chat-shaped messages are converted to Responses items so the rebuilt output
has one shape. Prompt positions are context (mask 0); generated positions are trainable
(mask 1).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from capture.codec.views import IdView, shares_prefix
from capture.records import TokenEntry

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
        items.append(_message_item(text, message.get("role") or "assistant"))
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
        items.append(_message_item("", message.get("role") or "assistant"))
    return items


def _message_item(text: str, role: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def to_responses_items(
    items: Sequence[Any], carrier: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """Copies of ``items`` in Responses shape, and where the carrier item ended up.

    Responses items are copied as they are; Chat messages are converted, and a converted
    carrier maps to the first item it produced.
    """
    converted: list[dict[str, Any]] = []
    new_carrier = None
    for index, item in enumerate(items):
        if index == carrier:
            new_carrier = len(converted)
        if is_chat_message(item):
            converted.extend(chat_message_to_items(item))
        elif isinstance(item, Mapping):
            converted.append(copy.deepcopy(dict(item)))
    return converted, new_carrier


def project_call(entry: TokenEntry) -> list[dict[str, Any]]:
    """One call's output items with its token arrays back on the carrier item.

    The arrays are the entry's own (not copies): a decoded entry's ids are views of its
    chain's shared sequence (``capture.codec.views.IdView``), so the record stays linear in
    the final context; a list per call would hold every prompt again (about 250 M list
    slots at 1,000 turns). Serializers write views with ``json_default``.
    """
    items, carrier = to_responses_items(entry.output_items, entry.token_item_index)
    if carrier is None or carrier >= len(items):
        if not items:
            items.append(_message_item("", "assistant"))
        carrier = len(items) - 1
    item = items[carrier]
    item["prompt_token_ids"] = entry.prompt_token_ids
    item["generation_token_ids"] = entry.generation_token_ids
    item["generation_log_probs"] = entry.generation_log_probs
    if entry.routed_experts is not None:
        item["routed_experts"] = entry.routed_experts
    if entry.policy_version is not None:
        item["policy_version"] = entry.policy_version
    return items


def project_chain(entries: Iterable[TokenEntry]) -> list[dict[str, Any]]:
    """The delivered chain's calls, in order, as one list of Responses output items."""
    output: list[dict[str, Any]] = []
    for entry in entries:
        output.extend(project_call(entry))
    return output


def carriers(items: Iterable[Any]) -> list[Mapping[str, Any]]:
    """The token-bearing items of an output list, in order."""
    return [
        item
        for item in items
        if isinstance(item, Mapping) and item.get("generation_token_ids") is not None
    ]


def flat_sequence(items: Iterable[Any]) -> tuple[list[int], list[int], list[float], int]:
    """The delivered sequence, its loss mask (0 context, 1 generated), the sampled log-probs
    aligned with it (0.0 at context positions) and how many carriers made it.

    Raises ValueError when the carriers are not contiguous (there is no one sequence).
    """
    ids: list[int] = []
    mask: list[int] = []
    log_probs: list[float] = []
    found = carriers(items)
    previous: Mapping[str, Any] | None = None
    for index, item in enumerate(found):
        prompt = item["prompt_token_ids"]
        generation = item["generation_token_ids"]
        if not _continues(prompt, previous) and prompt[: len(ids)] != ids:
            raise ValueError(
                f"carrier {index}'s prompt does not extend the sequence before it; "
                "the output is not contiguous"
            )
        context = prompt[len(ids) :]
        ids.extend(context)
        mask.extend([0] * len(context))
        log_probs.extend([0.0] * len(context))
        ids.extend(generation)
        mask.extend([1] * len(generation))
        log_probs.extend(item["generation_log_probs"])
        previous = item
    return ids, mask, log_probs, len(found)


def _continues(prompt: Sequence[int], previous: Mapping[str, Any] | None) -> bool:
    """Whether ``prompt`` provably starts with the previous carrier's prompt + generation,
    by identity (views of one chain's sequence): the sequence so far is exactly that, so a
    1,000-turn record is checked without comparing every prompt again."""
    if previous is None or not isinstance(prompt, IdView):
        return False
    return shares_prefix(prompt, previous["prompt_token_ids"], previous["generation_token_ids"])


def flat_ids_and_mask(items: Iterable[Any]) -> tuple[list[int], list[int]]:
    """The delivered sequence and its loss mask: 0 for context, 1 for generated positions.

    Raises ValueError when the carriers are not contiguous (there is no one sequence).
    """
    ids, mask, _, _ = flat_sequence(items)
    return ids, mask
