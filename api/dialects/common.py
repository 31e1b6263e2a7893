"""What the dialects share: the request error, text flattening, ids and tool-call arguments."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


class RequestError(ValueError):
    """The harness sent a request this dialect cannot translate; answered with a 400."""


def require_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RequestError(f"{where} must be an object, got {type(value).__name__}")
    return value


def require_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(f"{where} must be an array, got {type(value).__name__}")
    return value


def require_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {type(value).__name__}")
    return value


def joined_text(content: Any, where: str, text_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or the text parts of a block list joined by newlines (as vLLM joins them).

    Blocks of other types (images, documents, cache markers) are skipped: the policy sees
    text only.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for index, block in enumerate(require_list(content, where)):
        block = require_mapping(block, f"{where}[{index}]")
        if block.get("type") in text_types:
            parts.append(require_text(block.get("text", ""), f"{where}[{index}].text"))
    return "\n".join(parts)


def arguments_text(value: Any) -> str:
    """Tool-call arguments as the JSON text the chat template renders."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def arguments_object(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as an object for dialects that carry objects (Anthropic input)."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


LARGEST_INT = 2**63 - 1


def number(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...] = (int, float)) -> Any:
    """A numeric request field, or None; booleans are not numbers here.

    An integer field also takes an integral float (``2048.0``), as JSON does not tell them apart.
    """
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{key} must be a finite number")
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an integer" if kind is int else "a number"
        raise RequestError(f"{key} must be {what}, got {value!r}")
    if isinstance(value, int) and not -LARGEST_INT <= value <= LARGEST_INT:
        # An engine takes 64-bit integers (and the capture packs them): a larger one would
        # be sampled, then fail its capture.
        raise RequestError(f"{key} is out of range: at most {LARGEST_INT}")
    return value


def assistant_message(
    text: str, reasoning: str = "", tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The chat form of an assistant turn, shaped like the upstream's own reply.

    An upstream answers a tool-call-only turn with ``content: null``; re-sending the same
    shape lets the template render the turn exactly as it was generated.
    """
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text or not tool_calls else None,
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """One chat tool call."""
    return {
        "id": str(call_id or ""),
        "type": "function",
        "function": {"name": str(name or ""), "arguments": arguments_text(arguments)},
    }


def chat_request(
    body: Mapping[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    max_tokens_key: str,
) -> dict[str, Any]:
    """The chat-completions request every dialect builds: messages, tools, the length limit
    under the dialect's own name, and the sampling keys a harness may send."""
    request: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if tools:
        request["tools"] = tools
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
    max_tokens = number(body, max_tokens_key, int)
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    for key in ("temperature", "top_p"):
        if number(body, key) is not None:
            request[key] = body[key]
    return request


def openai_error_body(status: int, message: str) -> dict[str, Any]:
    """The error body of OpenAI's APIs (Chat Completions and Responses alike)."""
    kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
