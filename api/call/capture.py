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
from collections.abc import Mapping, Sequence
from typing import Any

from api.dialects.common import arguments_text
from api.engine.generation import Generation
from api.ids import item_id, new_id
from api.types import ServedCall
from capture.codec.packed import PackedIds
from capture.context import CallCapture, capture_entry, current_call, mark_incomplete
from capture.protocols import reads_packed_ids
from capture.records import VERSION_SPANS_FIELD, TokenEntry


def output_items(generation: Generation, reply_id: str | None = None) -> list[dict[str, Any]]:
    """The Responses output items of a completion, without token arrays, named after the
    reply they are served in (``item_id``)."""
    reply_id = reply_id or new_id("")
    items: list[dict[str, Any]] = []
    if generation.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": item_id("rs_", reply_id),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": generation.reasoning}],
            }
        )
    if generation.text or not generation.tool_calls:
        items.append(
            {
                "type": "message",
                "id": item_id("msg_", reply_id),
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": generation.text, "annotations": []}],
            }
        )
    for index, call in enumerate(generation.tool_calls):
        function = call.get("function")
        function = function if isinstance(function, Mapping) else {}
        items.append(
            {
                "type": "function_call",
                "id": item_id("fc_", reply_id, index),
                "call_id": str(call.get("id") or item_id("call_", reply_id, index)),
                "name": str(function.get("name") or ""),
                "arguments": arguments_text(function.get("arguments")),
                "status": "completed",
            }
        )
    return items


def call_entry(
    generation: Generation, items: list[dict[str, Any]], call: CallCapture
) -> TokenEntry:
    """The call's entry, straight from the typed generation: the arrays ride on the last item.

    ValueError when the arrays are inconsistent (say, fewer log-probs than ids). The
    adapter already checked every id and log-prob (``api.engine.generation``), so the entry is
    built without pydantic re-validating (and copying) a prompt of tens of thousands of ids.
    A sink that reads packed ids gets the prompt as its check packed it.
    """
    ids, log_probs = generation.generation_token_ids, generation.generation_log_probs
    if ids is None or log_probs is None or generation.prompt_token_ids is None:
        raise ValueError("the generation carries no token arrays")
    if len(ids) != len(log_probs):
        raise ValueError(f"{len(log_probs)} log-probs for {len(ids)} generated ids")
    if not items or not call.model_call_id:
        raise ValueError("a captured call needs output items and a call id")
    return TokenEntry.model_construct(
        rollout_id=call.rollout_id,
        model_call_id=call.model_call_id,
        model=str(generation.response.get("model") or ""),
        prompt_token_ids=_prompt_for(generation, call),
        generation_token_ids=generation.generation_token_ids,
        generation_log_probs=generation.generation_log_probs,
        output_items=[dict(item) for item in items],
        token_item_index=len(items) - 1,
        overridden_sampling_keys=list(generation.overridden_keys),
        created_at=time.time(),  # given: a default factory is looked up anew per construct
        **_clamp_field(generation),
        **_signal_fields(generation),
        **generation.entry_fields,
    )


def _prompt_for(generation: Generation, call: CallCapture) -> Sequence[int]:
    """Packed for a sink that reads packed ids; a list for any other (``TokenEntry``'s
    promise), also where the engine's reply was read packed (``api.engine.reply_ids``)."""
    packed = generation.prompt_packed
    if packed is not None and reads_packed_ids(call.sink):
        return PackedIds(packed)
    prompt = generation.prompt_token_ids or []
    return prompt.tolist() if isinstance(prompt, PackedIds) else prompt


def _signal_fields(generation: Generation) -> dict[str, Any]:
    """``routed_experts`` and ``policy_version`` where there are (else the defaults)."""
    fields: dict[str, Any] = {}
    if generation.routed_experts is not None:
        fields["routed_experts"] = generation.routed_experts
    if generation.policy_version is not None:
        fields["policy_version"] = generation.policy_version
    if generation.version_spans:
        fields[VERSION_SPANS_FIELD] = [list(span) for span in generation.version_spans]
    return fields


def _clamp_field(generation: Generation) -> dict[str, Any]:
    """``max_tokens_clamped`` for an entry whose ``max_tokens`` was lowered to fit."""
    if generation.max_tokens_clamp is None:
        return {}
    asked, sent = generation.max_tokens_clamp
    return {"max_tokens_clamped": {"asked": asked, "sent": sent}}


async def capture(generation: Generation, reply_id: str | None = None) -> ServedCall:
    """Capture the ids of a completion that is about to be served (in the reply
    ``reply_id``); never raises."""
    items = output_items(generation, reply_id)
    call = current_call()
    if call is None:
        return ServedCall(generation, items, None, "uncaptured")
    started = time.perf_counter()
    entry = None
    if generation.ids_problem is not None:
        await mark_incomplete(f"upstream ids unusable: {generation.ids_problem}")
    else:
        try:
            built = call_entry(generation, items, call)
        except ValueError as exc:
            await mark_incomplete(f"no usable token ids: {exc}")
        else:
            entry = await capture_entry(built)
    seconds = time.perf_counter() - started
    outcome = "captured" if entry is not None else "unrecorded" if call.unrecorded else "incomplete"
    return ServedCall(generation, items, entry, outcome, seconds)
