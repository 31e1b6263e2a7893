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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from capture.codec.views import IdView, shares_prefix
from capture.items import chat_message_to_items, is_chat_message, message_item
from capture.records import VERSION_SPANS_FIELD, TokenEntry


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
            items.append(message_item("", "assistant"))
        carrier = len(items) - 1
    item = items[carrier]
    item["prompt_token_ids"] = entry.prompt_token_ids
    item["generation_token_ids"] = entry.generation_token_ids
    item["generation_log_probs"] = entry.generation_log_probs
    if entry.routed_experts is not None:
        item["routed_experts"] = entry.routed_experts
    if entry.policy_version is not None:
        item["policy_version"] = entry.policy_version
    spans = (entry.model_extra or {}).get(VERSION_SPANS_FIELD)
    if spans:
        item[VERSION_SPANS_FIELD] = [list(span) for span in spans]
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
