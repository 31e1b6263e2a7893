"""What every wire does with a request before it shapes a reply: prompt, sampling, generation.

A wire (vLLM's or SGLang's routes) differs in field names and reply shapes, not in what is
generated: the same chat request gives the same prompt ids and the same sampled sequence on
either wire, so the ground truth means the same thing whichever one a test talks to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .generation import Engine, Generation, SamplingParams
from .pause import Batches
from .policies import Conversation
from .protocol import ChatCompletionRequest, SamplingFields
from .template import messages_from_prompt, tools_from_prompt


@dataclass(frozen=True)
class ChatCall:
    """A chat request's prompt ids and what was sampled for each of its choices."""

    prompt_ids: list[int]
    generations: list[Generation]

    @property
    def batches(self) -> Batches:
        return [(self.prompt_ids, self.generations)]


def sampling(
    engine: Engine, req: SamplingFields, max_tokens: int | None, top_logprobs: int
) -> SamplingParams:
    """The request's sampling fields; what it omits comes from the generation config, as a
    served model's ``generation_config.json`` fills them in vLLM."""
    defaults = engine.settings.generation_config
    return SamplingParams(
        temperature=req.temperature
        if req.temperature is not None
        else defaults.get("temperature", 1.0),
        top_p=req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
        top_k=req.top_k if req.top_k is not None else defaults.get("top_k", 0),
        max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
        seed=req.seed,
        stop=req.stop_list,
        top_logprobs=top_logprobs,
    )


def run_chat(engine: Engine, req: ChatCompletionRequest, top_logprobs: int) -> ChatCall:
    """Render the messages, let the policy answer, and sample every choice."""
    tools = req.tools or None
    tool_choice = req.effective_tool_choice
    prompt_ids = engine.chat_prompt_ids(req.messages, tools, req.add_generation_prompt)
    conversation = Conversation(req.messages, tools or [], tools_allowed=tool_choice != "none")
    generations = engine.generate(
        prompt_ids,
        conversation,
        sampling(engine, req, req.effective_max_tokens, top_logprobs),
        n=req.n or 1,
        tool_choice=tool_choice,
        parse_tools=bool(tools) and tool_choice != "none",
    )
    return ChatCall(prompt_ids, generations)


def token_prompt(engine: Engine, prompt: str | list[int]) -> tuple[list[int], Conversation]:
    """A raw prompt (text or ids), and the conversation the policy reads from it.

    Ids are decoded with special tokens kept, so a prompt rendered by the chat template
    reads back as the same messages and the policy answers it as it answers the chat call.
    """
    tokenizer = engine.tokenizer
    if isinstance(prompt, list):
        prompt_ids, text = list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    else:
        prompt_ids, text = tokenizer.encode(prompt), prompt
    messages = messages_from_prompt(text) or [{"role": "user", "content": text}]
    return prompt_ids, Conversation(messages, tools_from_prompt(text))


def out_of_vocabulary(engine: Engine, ids: list[int]) -> str | None:
    """Why these prompt ids cannot be served, or None."""
    vocab = engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        return f"token id out of vocabulary (0..{vocab - 1})"
    return None


def new_weight_version(engine: Engine, body: bytes) -> str | None:
    """A weight update as both engines take it (``POST /update_weight_version`` with
    ``new_version``): the version sequences sampled from now on are stamped with, or None
    when the body names none. Each wire answers in its engine's own shape."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    version = request.get("new_version") if isinstance(request, dict) else None
    if not isinstance(version, str) or not version:
        return None
    engine.weight_version = version
    return version
