"""Anthropic Messages: the dialect (``api.dialects.dialect.Dialect``) the Claude Code CLI speaks.

The request side is ``api.dialects.anthropic_request`` (``to_chat``); here the reply, its
stream of events (replayed whole, or relayed as the engine samples), and the error shape.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from api.dialects.anthropic_request import COUNT_SCHEMA as COUNT_SCHEMA
from api.dialects.anthropic_request import REQUEST_SCHEMA as REQUEST_SCHEMA
from api.dialects.anthropic_request import count_request as count_request
from api.dialects.anthropic_request import to_chat as to_chat
from api.dialects.common import arguments_object
from api.dialects.sse import event
from api.ids import new_id
from api.types import Delta, ServedCall

NAME = "anthropic"
PATH = "/v1/messages"

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # Claude Code retries it, as it retries 529
    529: "overloaded_error",
}


def content_blocks(captured: ServedCall) -> list[dict[str, Any]]:
    """The reply's content blocks, in the order the policy generated them."""
    blocks: list[dict[str, Any]] = []
    for item in captured.items:
        if item["type"] == "reasoning":
            text = "".join(part["text"] for part in item["content"])
            blocks.append({"type": "thinking", "thinking": text, "signature": ""})
        elif item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            if text:
                blocks.append({"type": "text", "text": text})
        elif item["type"] == "function_call":
            blocks.append(
                {
                    "type": "tool_use",
                    "id": item["call_id"],
                    "name": item["name"],
                    "input": arguments_object(item["arguments"]),
                }
            )
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def reply_head(body: Mapping[str, Any]) -> dict[str, Any]:
    """The reply's identity, fixed before the engine answers (a stream opens with it)."""
    return {
        "id": new_id("msg_"),
        "model": body.get("model") if isinstance(body.get("model"), str) else "",
    }


def reply(
    captured: ServedCall, body: Mapping[str, Any], head: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Messages reply to the harness: content only, never token arrays."""
    head = head or reply_head(body)
    generation = captured.generation
    stop_reason = STOP_REASONS.get(generation.finish_reason or "stop", "end_turn")
    stop_sequence = None
    matched = generation.stop_reason
    if (
        stop_reason == "end_turn"
        and isinstance(matched, str)
        and matched in (body.get("stop_sequences") or [])
    ):
        stop_reason, stop_sequence = "stop_sequence", matched
    if any(block["type"] == "tool_use" for block in content_blocks(captured)):
        stop_reason = "tool_use" if stop_reason == "end_turn" else stop_reason
    return {
        "id": head["id"],
        "type": "message",
        "role": "assistant",
        "model": head["model"],
        "content": content_blocks(captured),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": generation.prompt_tokens,
            "output_tokens": generation.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def error_body(status: int, message: str) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


# The stream ---------------------------------------------------------------------------


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


# The keep-alive Anthropic's API sends on a stream while nothing else is sent.
KEEPALIVE = event("ping", {"type": "ping"})


def _message_start(message: Mapping[str, Any]) -> bytes:
    return event("message_start", {"type": "message_start", "message": message})


def opening(head: Mapping[str, Any], body: Mapping[str, Any]) -> list[bytes]:
    """What a stream sends before the reply is known: ``message_start``, no usage yet."""
    usage = {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    message = {
        "id": head["id"],
        "type": "message",
        "role": "assistant",
        "model": head["model"],
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return [_message_start(message)]


def stream_error(
    head: Mapping[str, Any], body: Mapping[str, Any], status: int, message: str, sent: int
) -> bytes:
    """The event that ends a stream whose reply cannot be served (an error the SDKs raise)."""
    return event("error", error_body(status, message))


def _block_started(index: int, block: Mapping[str, Any]) -> bytes:
    return event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _block_delta_event(index: int, delta: Mapping[str, Any]) -> bytes:
    return event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def _block_stopped(index: int) -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})


def _ending(reply: Mapping[str, Any]) -> list[bytes]:
    """``message_delta`` (with the input tokens, which an early ``message_start`` could not
    know) and ``message_stop``: the final event."""
    usage = reply["usage"]
    stopped = {"stop_reason": reply["stop_reason"], "stop_sequence": reply["stop_sequence"]}
    counts = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}
    return [
        event("message_delta", {"type": "message_delta", "delta": stopped, "usage": counts}),
        event("message_stop", {"type": "message_stop"}),
    ]


class Relay:
    """A reply relayed as the engine samples it: each piece of reasoning, text or a tool
    call's arguments as a delta of its content block, a block per kind in the order they
    come; ``close`` ends the last block and the message once the call is captured."""

    def __init__(self, head: Mapping[str, Any], body: Mapping[str, Any]) -> None:
        self.index = -1
        self.kind: str | None = None

    def _switch(self, kind: str, block: Mapping[str, Any]) -> list[bytes]:
        sent = [_block_stopped(self.index)] if self.kind is not None else []
        self.index += 1
        self.kind = kind
        return [*sent, _block_started(self.index, block)]

    def delta(self, delta: Delta) -> list[bytes]:
        sent: list[bytes] = []
        if delta.reasoning:
            if self.kind != "thinking":
                sent += self._switch(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            sent.append(
                _block_delta_event(
                    self.index, {"type": "thinking_delta", "thinking": delta.reasoning}
                )
            )
        if delta.text:
            if self.kind != "text":
                sent += self._switch("text", {"type": "text", "text": ""})
            sent.append(_block_delta_event(self.index, {"type": "text_delta", "text": delta.text}))
        for piece in delta.tool_calls:
            kind = f"tool_use {piece['index']}"
            if self.kind != kind:
                block = {
                    "type": "tool_use",
                    "id": piece["id"] or new_id("toolu_"),
                    "name": piece["name"] or "",
                    "input": {},
                }
                sent += self._switch(kind, block)
            if piece["arguments"]:
                json_delta = {"type": "input_json_delta", "partial_json": piece["arguments"]}
                sent.append(_block_delta_event(self.index, json_delta))
        return sent

    def close(self, reply: Mapping[str, Any]) -> list[bytes]:
        if self.kind is None:  # nothing was sampled to show: one empty text block, as a reply has
            sent = [_block_started(0, {"type": "text", "text": ""}), _block_stopped(0)]
        else:
            sent = [_block_stopped(self.index)]
        return [*sent, *_ending(reply)]


def events(reply: Mapping[str, Any], body: Mapping[str, Any], opened: bool) -> list[bytes]:
    """The reply's events: ``message_start`` (unless the stream ``opened`` already), one
    start/delta/stop per content block, then ``_ending``."""
    sent: list[bytes] = []
    if not opened:
        start = copy.deepcopy(dict(reply))
        start.update(content=[], stop_reason=None, stop_sequence=None)
        start["usage"] = {**reply["usage"], "output_tokens": 0}
        sent.append(_message_start(start))
    for index, block in enumerate(reply["content"]):
        sent.append(_block_started(index, _block_start(block)))
        delta = _block_delta(block)
        if delta is not None:
            sent.append(_block_delta_event(index, delta))
        sent.append(_block_stopped(index))
    return [*sent, *_ending(reply)]
