"""Server-sent event streams synthesized from a complete reply, one function per dialect.

The upstream is called without streaming so the ids can be captured whole; the stream the
harness sees is then replayed from the finished reply. The capture put has completed before
the first event is produced, so it has certainly completed before the final one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(name: str | None, data: Any) -> bytes:
    """One SSE event; ``name`` None gives a data-only event (OpenAI Chat style)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {payload}\n\n".encode()


# Anthropic Messages --------------------------------------------------------------------


def _block_start(block: Mapping[str, Any]) -> dict[str, Any]:
    if block["type"] == "tool_use":
        return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _block_delta(block: Mapping[str, Any]) -> dict[str, Any] | None:
    if block["type"] == "tool_use":
        return {
            "type": "input_json_delta",
            "partial_json": json.dumps(block["input"], ensure_ascii=False),
        }
    if block["type"] == "thinking":
        return (
            {"type": "thinking_delta", "thinking": block["thinking"]} if block["thinking"] else None
        )
    return {"type": "text_delta", "text": block["text"]} if block["text"] else None


def anthropic_events(reply: Mapping[str, Any]) -> Iterator[bytes]:
    """message_start, one start/delta/stop per content block, message_delta, message_stop."""
    start = copy.deepcopy(dict(reply))
    start.update(content=[], stop_reason=None, stop_sequence=None)
    start["usage"] = {**reply["usage"], "output_tokens": 0}
    yield event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(reply["content"]):
        yield event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": _block_start(block)},
        )
        delta = _block_delta(block)
        if delta is not None:
            yield event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        yield event("content_block_stop", {"type": "content_block_stop", "index": index})
    yield event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": reply["stop_sequence"]},
            "usage": {"output_tokens": reply["usage"]["output_tokens"]},
        },
    )
    yield event("message_stop", {"type": "message_stop"})


# OpenAI Chat Completions ------------------------------------------------------------------


def chat_chunks(reply: Mapping[str, Any], include_usage: bool = False) -> Iterator[bytes]:
    """A role chunk, reasoning, content, one chunk per tool call, the finish, then [DONE]."""
    base = {
        "id": reply["id"],
        "object": "chat.completion.chunk",
        "created": reply["created"],
        "model": reply["model"],
    }
    choice = reply["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        body = {
            **base,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if include_usage:
            body["usage"] = None
        return event(None, body)

    yield chunk({"role": "assistant", "content": ""})
    if message.get("reasoning_content"):
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield event(None, {**base, "choices": [], "usage": reply["usage"]})
    yield event(None, "[DONE]")


# OpenAI Responses -------------------------------------------------------------------------


def _item_added(item: Mapping[str, Any]) -> dict[str, Any]:
    added = copy.deepcopy(dict(item))
    if item["type"] in ("message", "reasoning"):
        added["content"] = []
    if item["type"] == "function_call":
        added["arguments"] = ""
    if "status" in added:
        added["status"] = "in_progress"
    return added


def responses_events(reply: Mapping[str, Any]) -> Iterator[bytes]:
    """response.created ... one item at a time ... response.completed (or .incomplete)."""
    sequence = 0

    def emit(kind: str, /, **fields: Any) -> bytes:
        nonlocal sequence
        body = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return event(kind, body)

    opening = {**copy.deepcopy(dict(reply)), "status": "in_progress", "output": [], "usage": None}
    yield emit("response.created", response=opening)
    yield emit("response.in_progress", response=opening)
    for index, item in enumerate(reply["output"]):
        ids = {"item_id": item["id"], "output_index": index}
        yield emit("response.output_item.added", output_index=index, item=_item_added(item))
        if item["type"] == "message":
            for part_index, part in enumerate(item["content"]):
                at = {**ids, "content_index": part_index}
                empty = {**part, "text": ""}
                yield emit("response.content_part.added", **at, part=empty)
                if part["text"]:
                    yield emit("response.output_text.delta", **at, delta=part["text"], logprobs=[])
                yield emit("response.output_text.done", **at, text=part["text"], logprobs=[])
                yield emit("response.content_part.done", **at, part=part)
        elif item["type"] == "reasoning":
            for part_index, part in enumerate(item["content"]):
                at = {**ids, "content_index": part_index}
                yield emit("response.reasoning_text.delta", **at, delta=part["text"])
                yield emit("response.reasoning_text.done", **at, text=part["text"])
        elif item["type"] == "function_call":
            if item["arguments"]:
                yield emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield emit(
                "response.function_call_arguments.done",
                **ids,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield emit("response.output_item.done", output_index=index, item=item)
    final = "response.completed" if reply["status"] == "completed" else "response.incomplete"
    yield emit(final, response=reply)
