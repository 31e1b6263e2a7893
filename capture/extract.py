"""Pull the token arrays out of a served response and store them once.

A served response carries the ids on exactly one item: an ``output[*]`` item (Responses
shape) or a ``choices[*].message`` (Chat shape). The arrays are moved into the entry and
stripped from the kept items, so they are stored once. A response that carries them on two
items, or carries only some of the three arrays, is an error rather than a guess.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from capture.errors import ExtractionError, MissingTokenIdsError
from capture.records import TOKEN_FIELDS, TokenEntry


def _items_of(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    if isinstance(response.get("output"), list):
        return [dict(item) if isinstance(item, Mapping) else item for item in response["output"]]
    if isinstance(response.get("choices"), list):
        items = []
        for choice in response["choices"]:
            message = choice.get("message") if isinstance(choice, Mapping) else None
            items.append(dict(message) if isinstance(message, Mapping) else {})
        return items
    raise ExtractionError("response has neither an 'output' list nor a 'choices' list")


def split_token_arrays(
    response: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], int, dict[str, list[Any]]]:
    """Return (stripped items, carrier index, the three arrays) of a served response."""
    # The token arrays are copied by list() below; deep-copying them too would cost
    # milliseconds per call on long prompts.
    items = [
        {k: v if k in TOKEN_FIELDS else copy.deepcopy(v) for k, v in item.items()}
        if isinstance(item, dict)
        else copy.deepcopy(item)
        for item in _items_of(response)
    ]
    carriers = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ExtractionError(f"output item {index} is not an object")
        present = [name for name in TOKEN_FIELDS if item.get(name) is not None]
        if not present:
            continue
        if len(present) != len(TOKEN_FIELDS):
            missing = sorted(set(TOKEN_FIELDS) - set(present))
            raise ExtractionError(
                f"output item {index} carries {', '.join(present)} but not {', '.join(missing)}"
            )
        carriers.append(index)
    if not carriers:
        raise MissingTokenIdsError("response carries no token ids on any output item")
    if len(carriers) > 1:
        raise ExtractionError(
            f"response carries token ids on {len(carriers)} items ({carriers}); expected one"
        )
    index = carriers[0]
    arrays = {name: list(items[index].pop(name)) for name in TOKEN_FIELDS}
    return items, index, arrays


def entry_from_response(
    response: Mapping[str, Any],
    *,
    rollout_id: str,
    model_call_id: str,
    model: str | None = None,
    **extra: Any,
) -> TokenEntry:
    """Build the entry of one call from its served response (Responses or Chat shape)."""
    items, index, arrays = split_token_arrays(response)
    routed = None
    carrier = items[index]
    if "routed_experts" in carrier:
        routed = carrier.pop("routed_experts")
    try:
        return TokenEntry(
            rollout_id=rollout_id,
            model_call_id=model_call_id,
            model=model if model is not None else str(response.get("model") or ""),
            routed_experts=routed,
            output_items=items,
            token_item_index=index,
            **arrays,
            **extra,
        )
    except ValueError as exc:
        raise ExtractionError(f"token ids of the response are inconsistent: {exc}") from exc
