"""OpenAI Chat Completions <-> the upstream's chat-completions request and reply.

The upstream already speaks this dialect, so translation is mostly selection: the messages,
tools and sampling fields pass through; the fields that belong to the capture (``logprobs``,
``n``, ``stream``, the token-id switches) are the front end's own. The reply carries the
message only: no log-probs and no token ids reach the harness.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from api.dialects.common import (
    RequestError,
    number,
    openai_error_body,
    require_list,
    require_mapping,
)
from api.dialects.sse import event
from api.ids import new_id
from api.types import Delta, ServedCall

NAME = "chat"
PATH = "/v1/chat/completions"

# Request fields forwarded upstream as sent (sampling and rendering, not capture).
PASSED = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "response_format",
    "chat_template_kwargs",
)
ROLES = ("system", "developer", "user", "assistant", "tool")
REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["system", "developer", "user"]},
                    "content": {"type": "string"},
                },
            },
        },
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": {"type": "integer"},
        "n": {"type": "integer", "minimum": 1, "maximum": 1},
    },
}


def _message(message: Any, where: str) -> dict[str, Any]:
    message = dict(require_mapping(message, where))
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "developer":
        message["role"] = "system"
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise RequestError(f"{where}.content must be a string, an array or null")
    return message


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The upstream request for a Chat Completions request."""
    n = number(body, "n", int)
    if n is not None and n != 1:
        raise RequestError(f"n={n} is not supported: each call samples one choice (n=1)")
    messages = require_list(body.get("messages"), "messages")
    request: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
    }
    for key in PASSED:
        if body.get(key) is not None:
            request[key] = body[key]
    max_tokens = number(body, "max_completion_tokens", int) or number(body, "max_tokens", int)
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "seed"):
        number(body, key)
    return request


def reply_head(body: Mapping[str, Any]) -> dict[str, Any]:
    """The reply's identity, fixed before the engine answers (a stream opens with it)."""
    return {
        "id": new_id("chatcmpl-"),
        "created": int(time.time()),
        "model": body.get("model") if isinstance(body.get("model"), str) else "",
    }


def reply(
    captured: ServedCall, body: Mapping[str, Any], head: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The chat completion served to the harness (no log-probs, no token ids)."""
    head = head or reply_head(body)
    generation = captured.generation
    message: dict[str, Any] = {"role": "assistant", "content": generation.message.get("content")}
    if generation.reasoning:
        message["reasoning_content"] = generation.reasoning
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in captured.items
        if item["type"] == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return {
        "id": head["id"],
        "object": "chat.completion",
        "created": head["created"],
        "model": head["model"],
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": generation.finish_reason or "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


error_body = openai_error_body


# An SSE comment: what a stream sends while nothing else is (SDKs skip comment lines).
KEEPALIVE = b": keep-alive\n\n"


def _chunk(
    head: Mapping[str, Any], body: Mapping[str, Any], delta: dict[str, Any], finish: Any = None
) -> bytes:
    chunk_body: dict[str, Any] = {
        "id": head["id"],
        "object": "chat.completion.chunk",
        "created": head["created"],
        "model": head["model"],
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if include_usage(body):
        chunk_body["usage"] = None
    return event(None, chunk_body)


def opening(head: Mapping[str, Any], body: Mapping[str, Any]) -> list[bytes]:
    """What a stream sends before the reply is known: the role chunk."""
    return [_chunk(head, body, {"role": "assistant", "content": ""})]


def stream_error(
    head: Mapping[str, Any], body: Mapping[str, Any], status: int, message: str, sent: int
) -> bytes:
    """The data event that ends a stream whose reply cannot be served: an object with
    ``error``, which the OpenAI SDK raises (as vLLM ends a failed stream)."""
    return event(None, error_body(status, message))


def _ending(reply: Mapping[str, Any], body: Mapping[str, Any]) -> list[bytes]:
    """The finish chunk, the usage when asked, then [DONE]: the final event."""
    head = {key: reply[key] for key in ("id", "created", "model")}
    sent = [_chunk(head, body, {}, reply["choices"][0]["finish_reason"])]
    if include_usage(body):
        usage = {**head, "object": "chat.completion.chunk", "choices": [], "usage": reply["usage"]}
        sent.append(event(None, usage))
    sent.append(event(None, "[DONE]"))
    return sent


class Relay:
    """A reply relayed as the engine samples it, one chunk per piece, as vLLM streams it;
    ``close`` sends the finish once the call is captured."""

    def __init__(self, head: Mapping[str, Any], body: Mapping[str, Any]) -> None:
        self.head = head
        self.body = body

    def delta(self, delta: Delta) -> list[bytes]:
        sent = []
        if delta.reasoning:
            sent.append(_chunk(self.head, self.body, {"reasoning_content": delta.reasoning}))
        if delta.text:
            sent.append(_chunk(self.head, self.body, {"content": delta.text}))
        for piece in delta.tool_calls:
            call: dict[str, Any] = {"index": piece["index"]}
            function: dict[str, Any] = {"arguments": piece["arguments"]}
            if piece["id"] is not None:  # a call's first piece names it
                call.update(id=piece["id"], type="function")
                function["name"] = piece["name"] or ""
            call["function"] = function
            sent.append(_chunk(self.head, self.body, {"tool_calls": [call]}))
        return sent

    def close(self, reply: Mapping[str, Any]) -> list[bytes]:
        return _ending(reply, self.body)


def events(reply: Mapping[str, Any], body: Mapping[str, Any], opened: bool) -> list[bytes]:
    """A role chunk (unless the stream ``opened`` already), reasoning, content, one chunk
    per tool call, then ``_ending``."""
    head = {key: reply[key] for key in ("id", "created", "model")}
    message = reply["choices"][0]["message"]
    sent = [] if opened else opening(head, body)
    if message.get("reasoning_content"):
        sent.append(_chunk(head, body, {"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        sent.append(_chunk(head, body, {"content": message["content"]}))
    for index, call in enumerate(message.get("tool_calls") or []):
        sent.append(_chunk(head, body, {"tool_calls": [{"index": index, **call}]}))
    return [*sent, *_ending(reply, body)]
