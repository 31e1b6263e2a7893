"""The request side of Anthropic Messages: one chat-completions request for a Messages request.

System text (a string or text blocks) becomes the first system message; a ``role: "system"``
message in mid-conversation (what Claude Code sends for models it does not know) stays a
system message where it stands. User text blocks become user messages, ``tool_result``
blocks tool messages, assistant ``thinking`` the reasoning, ``tool_use`` tool calls.
``cache_control``, ``metadata``, ``thinking`` settings, ``context_management`` and any field
this module does not know are ignored: they change nothing the policy sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.dialects.common import (
    RequestError,
    assistant_message,
    chat_request,
    joined_text,
    number,
    require_list,
    require_mapping,
    require_text,
    tool_call,
)

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
