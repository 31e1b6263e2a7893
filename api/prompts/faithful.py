"""Faithful prompts: the front end builds every prompt and reads every reply from the ids.

The engine never re-renders sampled history. For each request:

1. ``build``: find the recorded call its history continues (``api.prompts.lineage``) and
   extend that call's prompt and sampled ids with the new messages
   (``bridge_to_next_turn``); with no such call, or a bridge the renderer refuses, render
   the whole conversation (a new root) and name why (``fallback``);
2. the upstream client sends those ids token-in, with the renderer's stop tokens;
3. ``served``: parse the sampled ids with the renderer into text, reasoning and tool calls,
   so what the harness is shown comes from exactly the ids captured, and attach the
   lineage keys of the conversation it now ends (request history plus this reply) for
   the entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from api.dialects.common import RequestError, tool_call
from api.engine.generation import Generation, with_changes
from api.ids import new_id
from api.prompts.canonical import Lineage, split_history
from api.prompts.lineage import LineageMemory, find_continued
from api.prompts.route_prefix import prefix_for
from capture.codec.route_blocks import ChainedRoutes
from capture.context import current_call
from capture.lineage import FALLBACK_FIELD, LINEAGE_FIELD
from capture.routes import RouteChain

# Sampling fields of a chat request that a token-in call carries as they are.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")
# Why a prompt that has an assistant turn in its history was rendered whole.
NO_MATCH = "no_match"
BRIDGE_REFUSED = "bridge_refused"
# What a renderer raises for a conversation it cannot render (odd roles, content, tools).
RENDER_ERRORS = (ValueError, TypeError, KeyError, AttributeError, AssertionError, IndexError)


@dataclass(frozen=True)
class Prompt:
    """The ids one call is sent, and how they were made."""

    ids: list[int]
    sampling: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    lineage: Lineage  # of the request's messages: the reply's keys extend it
    tools_allowed: bool = True  # False for tool_choice "none": calls stay text, as in vLLM
    continued: str | None = None  # the call this prompt extends, if any
    found_in: str | None = None  # where that call was found: "memory" or "store"
    fallback: str | None = None  # why it was rendered whole despite an assistant turn
    # The continued call's stored routes this call's ids share (``api.prompts.route_prefix``).
    routes_prefix: RouteChain | None = None

    @property
    def how(self) -> str:
        """How the prompt was made, for the ``x-tokcap-prompt`` header and the metrics."""
        if self.continued is not None:
            return f"continued:{self.found_in}"
        return f"fallback:{self.fallback}" if self.fallback else "root"


class FaithfulPrompts:
    """Builds prompts with one renderer and remembers the calls this worker served."""

    def __init__(
        self, renderer: Any, memory: LineageMemory | None = None, vocab: Any = None
    ) -> None:
        self.renderer = renderer
        self.vocab = vocab  # the renderer's tokenizer, when the caller has it
        self.memory = memory or LineageMemory()
        self.stop_token_ids = list(renderer.get_stop_token_ids())

    def sampling(self, chat_request: Mapping[str, Any]) -> dict[str, Any]:
        params = {key: chat_request[key] for key in SAMPLING_KEYS if key in chat_request}
        params["stop_token_ids"] = self.stop_token_ids
        return params

    def render(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        """The whole conversation rendered; RequestError when the renderer refuses it."""
        try:
            return list(self.renderer.render_ids(messages, tools=tools, add_generation_prompt=True))
        except RENDER_ERRORS as exc:
            raise RequestError(f"the conversation cannot be rendered: {exc}") from None

    async def build(self, chat_request: Mapping[str, Any]) -> Prompt:
        messages = list(chat_request.get("messages") or [])
        tools = list(chat_request.get("tools") or []) or None
        allowed = chat_request.get("tool_choice") != "none"
        lineage = Lineage.of(messages, tools)
        prompt = Prompt([], self.sampling(chat_request), messages, tools, lineage, allowed)
        history, new = split_history(messages)
        if not history:
            return replace(prompt, ids=self.render(messages, tools))
        found = await find_continued(self.memory, lineage.history)
        if found is None:
            return replace(prompt, ids=self.render(messages, tools), fallback=NO_MATCH)
        try:
            bridged = self.renderer.bridge_to_next_turn(
                found.prompt_ids, found.completion_ids, new, tools=tools
            )
        except RENDER_ERRORS:
            bridged = None  # what the bridge cannot read, a whole render may (or refuses)
        if bridged is None:
            return replace(prompt, ids=self.render(messages, tools), fallback=BRIDGE_REFUSED)
        ids = list(bridged.token_ids)
        previous = [*found.prompt_ids, *found.completion_ids] if found.routes_chain else []
        return replace(
            prompt,
            ids=ids,
            continued=found.model_call_id,
            found_in=found.found_in,
            routes_prefix=prefix_for(found.routes_chain, ids, previous),
        )

    def served(self, prompt: Prompt, generation: Generation) -> Generation:
        """The generation as the harness is served it: parsed from its ids, with lineage."""
        if generation.ids_problem is not None or generation.generation_token_ids is None:
            return generation
        ids = generation.generation_token_ids
        message = self.parsed_message(ids, prompt)
        keys = prompt.lineage.with_reply(message).all_names()
        call = current_call()
        if call is not None:
            routes = generation.routed_experts
            chain = routes.chain if isinstance(routes, ChainedRoutes) else None
            self.memory.remember(call.rollout_id, keys, call.model_call_id, prompt.ids, ids, chain)
        finish = generation.finish_reason
        if message.get("tool_calls") and finish in (None, "stop"):
            finish = "tool_calls"
        fields: dict[str, Any] = {LINEAGE_FIELD: keys}
        if prompt.fallback is not None:
            fields[FALLBACK_FIELD] = prompt.fallback
        return with_changes(generation, message=message, finish_reason=finish, entry_fields=fields)

    def parsed_message(self, ids: list[int], prompt: Prompt) -> dict[str, Any]:
        """Text, reasoning and tool calls of sampled ids, as the renderer's parser reads them.

        A tool call that does not parse stays in the text (as vLLM's tool parsers leave it),
        so nothing sampled is hidden from the harness.
        """
        parsed = self.renderer.parse_response(ids, tools=prompt.tools, prompt_ids=prompt.ids)
        text = parsed.content or ""
        calls = []
        for call in parsed.tool_calls:
            if prompt.tools_allowed and str(call.status) == "ok" and call.name:
                arguments = call.arguments if call.arguments is not None else {}
                calls.append(tool_call(call.id or new_id("call_"), call.name, arguments))
            else:
                text = f"{text}\n{call.raw}" if text else call.raw
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not calls else None,
        }
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        if calls:
            message["tool_calls"] = calls
        return message


def faithful_prompts(settings: Any) -> FaithfulPrompts | None:
    """The prompt builder ``ServerSettings`` ask for; None in text mode."""
    if settings.prompts != "faithful":
        return None
    # Imported here: ``renderers`` takes 0.6 s to import, which text mode need not pay.
    from api.prompts.renderer import load_renderer

    renderer, vocab = load_renderer(
        settings.renderer.name, settings.renderer.tokenizer, settings.renderer.thinking_retention
    )
    return FaithfulPrompts(renderer, vocab=vocab)
