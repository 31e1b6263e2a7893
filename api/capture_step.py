"""Turn one upstream completion into the served output items and capture its ids.

Whatever dialect the harness speaks, a call is recorded in the Responses shape: reasoning,
message and function_call items, with the three token arrays on one carrier item (the last,
which ends the generation). The reply step reads the same items, so what is stored is what
was served. Capture never raises into the call: ids that are missing or disagree mark the
rollout incomplete, because a reply without ids reaches the harness all the same, once
that loss is durable.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from api.dialects.common import arguments_text, new_id
from api.upstream import Generation
from capture.context import capture_tokens, current_call, mark_incomplete
from capture.records import TokenEntry


@dataclass(frozen=True)
class CapturedCall:
    """A completion, the items served for it, and the outcome of its capture."""

    generation: Generation
    items: list[dict[str, Any]]
    entry: TokenEntry | None
    # "captured", "incomplete" (its loss is recorded), "unrecorded" (neither the entry nor
    # its loss became durable: the harness must not get the reply) or "uncaptured" (no
    # capture context: an untagged path).
    outcome: str
    put_seconds: float = 0.0


def output_items(generation: Generation) -> list[dict[str, Any]]:
    """The Responses output items of a completion, without token arrays."""
    items: list[dict[str, Any]] = []
    if generation.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": new_id("rs_"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": generation.reasoning}],
            }
        )
    if generation.text or not generation.tool_calls:
        items.append(
            {
                "type": "message",
                "id": new_id("msg_"),
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": generation.text, "annotations": []}],
            }
        )
    for call in generation.tool_calls:
        function = call.get("function")
        function = function if isinstance(function, Mapping) else {}
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": str(call.get("id") or new_id("call_")),
                "name": str(function.get("name") or ""),
                "arguments": arguments_text(function.get("arguments")),
                "status": "completed",
            }
        )
    return items


def carrier_response(generation: Generation, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The served response with the token arrays on the last item (what gets extracted)."""
    served = [dict(item) for item in items]
    served[-1].update(
        prompt_token_ids=generation.prompt_token_ids,
        generation_token_ids=generation.generation_token_ids,
        generation_log_probs=generation.generation_log_probs,
    )
    return {"model": str(generation.response.get("model") or ""), "output": served}


async def capture(generation: Generation) -> CapturedCall:
    """Capture the ids of a completion that is about to be served; never raises."""
    items = output_items(generation)
    call = current_call()
    if call is None:
        return CapturedCall(generation, items, None, "uncaptured")
    started = time.perf_counter()
    entry = None
    if generation.ids_problem is not None:
        await mark_incomplete(f"upstream ids unusable: {generation.ids_problem}")
    else:
        entry = await capture_tokens(
            carrier_response(generation, items),
            overridden_sampling_keys=list(generation.overridden_keys),
        )
    seconds = time.perf_counter() - started
    outcome = "captured" if entry is not None else "unrecorded" if call.unrecorded else "incomplete"
    return CapturedCall(generation, items, entry, outcome, seconds)
