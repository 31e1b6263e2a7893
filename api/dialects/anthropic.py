"""Anthropic Messages <-> one chat-completions request and its reply.

System text (a string or text blocks) becomes the first system message; a ``role: "system"``
message in mid-conversation (what Claude Code sends for models it does not know) stays a
system message where it stands. User text blocks become user messages, ``tool_result``
blocks tool messages, assistant ``thinking`` the reasoning, ``tool_use`` tool calls.
``cache_control``, ``metadata``, ``thinking`` settings, ``context_management`` and any field
this module does not know are ignored: they change nothing the policy sees.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any

from api.dialects.common import (
    RequestError,
    arguments_object,
    assistant_message,
    chat_request,
    joined_text,
    number,
    require_list,
    require_mapping,
    require_text,
    tool_call,
)
from api.dialects.sse import event
from api.ids import new_id
from api.types import Delta, ServedCall

NAME = "anthropic"

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
_TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]}
# The request fields the OpenAPI document names; any others are accepted and ignored.
REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant", "system"]},
                    "content": _CONTENT,
                },
            },
        },
        "system": _CONTENT,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
            },
        },
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
    },
}
COUNT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        k: REQUEST_SCHEMA["properties"][k] for k in ("model", "messages", "system", "tools")
    },
}


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for index, block in enumerate(require_list(content, where)):
        block = require_mapping(block, f"{where}[{index}]")
        kind = block.get("type")
        if kind == "text":
            texts.append(require_text(block.get("text", ""), f"{where}[{index}].text"))
        elif kind == "tool_result":
            flush()
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id") or ""),
                    "content": joined_text(block.get("content"), f"{where}[{index}].content"),
                }
            )
    flush()
    return messages


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thinking: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for index, block in enumerate(require_list(content, where)):
        block = require_mapping(block, f"{where}[{index}]")
        kind = block.get("type")
        if kind == "text":
            texts.append(require_text(block.get("text", ""), f"{where}[{index}].text"))
        elif kind == "thinking":
            thinking.append(require_text(block.get("thinking", ""), f"{where}[{index}].thinking"))
        elif kind == "tool_use":
            tool_calls.append(tool_call(block.get("id"), block.get("name"), block.get("input")))
    return assistant_message("".join(texts), "".join(thinking), tool_calls)


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages request, system first."""
    messages: list[dict[str, Any]] = []
    system = joined_text(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(require_list(body.get("messages"), "messages")):
        where = f"messages[{index}]"
        message = require_mapping(message, where)
        role, content = message.get("role"), message.get("content")
        if role == "user":
            messages.extend(_user_messages(content, f"{where}.content"))
        elif role == "assistant":
            messages.append(_assistant_message(content, f"{where}.content"))
        elif role == "system":
            messages.append({"role": "system", "content": joined_text(content, f"{where}.content")})
        else:
            raise RequestError(f"{where}.role must be user, assistant or system, got {role!r}")
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Client tools as chat functions; server tools and malformed entries are skipped."""
    if tools is None:
        return []
    result = []
    for tool in require_list(tools, "tools"):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            continue
        if "input_schema" not in tool:
            continue  # a server tool (web search, code execution): nothing the policy calls
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        result.append({"type": "function", "function": function})
    return result


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, Mapping):
        return None
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind)


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """One chat-completions request for a Messages request."""
    request = chat_request(
        body,
        chat_messages(body),
        chat_tools(body.get("tools")),
        _tool_choice(body.get("tool_choice")),
        "max_tokens",
    )
    top_k = number(body, "top_k", int)
    if top_k is not None:
        request["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops:
        request["stop"] = [
            require_text(s, "stop_sequences[]") for s in require_list(stops, "stop_sequences")
        ]
    return request


def count_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request whose rendered prompt ``count_tokens`` measures."""
    request: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages(body)}
    tools = chat_tools(body.get("tools"))
    if tools:
        request["tools"] = tools
    return request


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


def stream(reply: Mapping[str, Any], body: Mapping[str, Any]) -> Iterator[bytes]:
    """message_start, one start/delta/stop per content block, message_delta, message_stop."""
    yield from events(reply, body, opened=False)
