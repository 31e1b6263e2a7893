"""The request side of OpenAI Responses: one chat-completions request for a Responses request.

Input items become chat messages: ``message`` items by role, ``function_call_output`` items
tool messages. An assistant turn arrives as several items (``reasoning``, then a
``message``, then ``function_call`` items, the order this server emits them) and is merged
back into the one assistant message the upstream produced, so the template renders it as it
was generated. There is no server-side state: ``previous_response_id`` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.dialects.common import (
    RequestError,
    assistant_message,
    chat_request,
    joined_text,
    require_list,
    require_mapping,
    require_text,
    tool_call,
)

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "system": "system", "developer": "system"}
_MESSAGE_ITEM = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"enum": ["message"]},
        "role": {"enum": ["user", "system", "developer"]},
        "content": {"type": "string"},
    },
}
REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _MESSAGE_ITEM}]
        },
        "instructions": {"type": "string"},
        "stream": {"type": "boolean"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    },
}


class _Turns:
    """Accumulates chat messages, merging consecutive assistant items into one turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def flush(self) -> None:
        if self.text or self.reasoning or self.calls:
            message = assistant_message("".join(self.text), "".join(self.reasoning), self.calls)
            self.messages.append(message)
        self.text, self.reasoning, self.calls = [], [], []

    def add(self, item: Mapping[str, Any], where: str) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            content = joined_text(item.get("content"), f"{where}.content", TEXT_PARTS)
            if role == "assistant":
                if self.calls:
                    self.flush()
                self.text.append(content)
            elif role in ROLES:
                self.flush()
                self.messages.append({"role": ROLES[role], "content": content})
            else:
                raise RequestError(f"{where}.role must be user, system, developer or assistant")
        elif kind == "reasoning":
            if self.text or self.calls:
                self.flush()
            parts = item.get("content") or item.get("summary") or []
            types = ("reasoning_text", "summary_text")
            self.reasoning.append(joined_text(parts, f"{where}.content", types))
        elif kind == "function_call":
            self.calls.append(
                tool_call(item.get("call_id"), item.get("name"), item.get("arguments"))
            )
        elif kind == "function_call_output":
            self.flush()
            output = item.get("output")
            content = joined_text(output, f"{where}.output", TEXT_PARTS)
            self.messages.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": content}
            )
        # Other item types (web search calls, references) carry nothing the policy rendered.


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    turns = _Turns()
    instructions = body.get("instructions")
    if instructions is not None:
        turns.messages.append(
            {"role": "system", "content": require_text(instructions, "instructions")}
        )
    source = body.get("input")
    if isinstance(source, str):
        turns.messages.append({"role": "user", "content": source})
        return turns.messages
    for index, item in enumerate(require_list(source, "input")):
        turns.add(require_mapping(item, f"input[{index}]"), f"input[{index}]")
    turns.flush()
    return turns.messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    result = []
    for tool in require_list(tools, "tools") if tools is not None else []:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            continue
        function = {"name": str(tool.get("name") or ""), "parameters": tool.get("parameters") or {}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        result.append({"type": "function", "function": function})
    return result


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": str(choice["name"])}}
    return None


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """One chat-completions request for a Responses request."""
    if body.get("previous_response_id"):
        raise RequestError(
            "previous_response_id is not supported: this server keeps no responses; "
            "send the whole conversation as input"
        )
    return chat_request(
        body,
        chat_messages(body),
        _tools(body.get("tools")),
        _tool_choice(body.get("tool_choice")),
        "max_output_tokens",
    )
