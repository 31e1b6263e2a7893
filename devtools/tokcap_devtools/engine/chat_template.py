"""How a chat request becomes prompt ids: the shipped ChatML template, or Qwen3's real one.

With a ``tokenizer.json`` (the shipped one by default) the engine renders the ChatML Jinja
template of ``tokcap_devtools.engine.template`` to text and encodes it; what re-rendering loses there is
what the knobs make it lose. With ``--tokenizer qwen3`` it renders with the ``renderers``
package's Qwen3 renderer, straight to ids, so what is lost is what Qwen3's template loses:
the thinking of assistant turns before the last user query, the spacing of tool-call
arguments (re-serialized by ``json.dumps``), tool results written as user turns of
``<tool_response>`` blocks. ``think_strip`` does nothing there: the template decides.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from api import qwen3_tokenizer

from .template import render
from .tokenizer import QWEN3, EngineTokenizer


class ChatTemplate(Protocol):
    def render_ids(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True
    ) -> list[int]: ...


class ChatMLTemplate:
    """The shipped template: rendered to text with special tokens written, then encoded."""

    def __init__(self, tokenizer: EngineTokenizer, *, think_strip: bool = False) -> None:
        self.tokenizer = tokenizer
        self.think_strip = think_strip

    def render_ids(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        text = render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            think_strip=self.think_strip,
        )
        return self.tokenizer.encode(text)


class Qwen3Template:
    """Qwen3's chat template, as the ``renderers`` package mirrors it (text only)."""

    def __init__(self) -> None:
        # Imported here: loading ``renderers`` takes most of a second, paid by qwen3 only.
        from renderers import Qwen3RendererConfig, create_renderer

        self._renderer = create_renderer(qwen3_tokenizer(), Qwen3RendererConfig())

    def render_ids(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        return self._renderer.render_ids(
            template_messages(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
        )


def _arguments(arguments: Any) -> Any:
    """A tool call's arguments as the template gets them: parsed if they are a JSON text."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments  # vLLM would refuse the request; the engine renders it as sent
    return arguments


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as vLLM and SGLang hand them to a model's template: an assistant's
    tool-call arguments parsed from OpenAI's JSON strings into objects (``chat_utils.py``
    ``_postprocess_messages``), so the template re-serializes them its own way."""
    prepared = []
    for message in messages:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_with_parsed_arguments(c) for c in calls]}
        prepared.append(message)
    return prepared


def _with_parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}}


def chat_template(tokenizer: EngineTokenizer, *, think_strip: bool = False) -> ChatTemplate:
    """The template that goes with the vocabulary served: Qwen3's for ``qwen3``, else ChatML."""
    if tokenizer.name_or_path == QWEN3:
        return Qwen3Template()
    return ChatMLTemplate(tokenizer, think_strip=think_strip)


__all__ = ["ChatTemplate", "ChatMLTemplate", "Qwen3Template", "chat_template", "template_messages"]
