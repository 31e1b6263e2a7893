"""OpenAI Chat Completions <-> the upstream's chat-completions request and reply.

The upstream already speaks this dialect, so translation is mostly selection: the messages,
tools and sampling fields pass through; the fields that belong to the capture (``logprobs``,
``n``, ``stream``, the token-id switches) are the front end's own. The reply carries the
message only: no log-probs and no token ids reach the harness.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from api.dialects.common import (
    RequestError,
    new_id,
    number,
    openai_error_body,
    require_list,
    require_mapping,
)
from api.sse import event
from api.types import CapturedCall

NAME = "chat"

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


def reply(captured: CapturedCall, body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion served to the harness (no log-probs, no token ids)."""
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
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") if isinstance(body.get("model"), str) else "",
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


def stream(reply: Mapping[str, Any], body: Mapping[str, Any]) -> Iterator[bytes]:
    """A role chunk, reasoning, content, one chunk per tool call, the finish, then [DONE]."""
    with_usage = include_usage(body)
    base = {
        "id": reply["id"],
        "object": "chat.completion.chunk",
        "created": reply["created"],
        "model": reply["model"],
    }
    choice = reply["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk_body = {
            **base,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if with_usage:
            chunk_body["usage"] = None
        return event(None, chunk_body)

    yield chunk({"role": "assistant", "content": ""})
    if message.get("reasoning_content"):
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, choice["finish_reason"])
    if with_usage:
        yield event(None, {**base, "choices": [], "usage": reply["usage"]})
    yield event(None, "[DONE]")
