"""The interface every engine family implements, and what the families share.

The neutral client (``api.engine.client``) knows no engine's fields: it asks its adapter
for each request body and hands it each reply. A new family is one module with one class
that satisfies ``EngineAdapter`` and a line in ``api.engine.FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from api.engine.checks import finish, prompt_check
from api.engine.generation import (
    Generation,
    UpstreamError,
    first_choice,
    reply_generation,
    with_changes,
)
from api.types import Delta
from capture.routes import Routes

# A GET on the engine: (status, parsed JSON body); (0, None) when it could not be reached.
Ask = Callable[[str], Awaitable[tuple[int, Any]]]
# A POST of a JSON body to the engine: its JSON object reply (UpstreamError otherwise).
Post = Callable[[str, Mapping[str, Any]], Awaitable[dict[str, Any]]]
# A POST whose answer is only its status (an engine's control routes answer text or
# nothing); UpstreamError unless the engine took it.
Command = Callable[[str, Mapping[str, Any] | None], Awaitable[None]]
# What one chat reply's choice gives an adapter: generated ids, log-probs, or why not.
ReadIds = tuple[list[int] | None, list[float] | None, str | None]

# What every chat call asks for, whatever the engine: log-probs of the sampled ids (no
# alternatives), the ids themselves, one choice, the whole reply.
CHAT_PARAMS: dict[str, Any] = {
    "logprobs": True,
    "top_logprobs": 0,
    "return_token_ids": True,
    "n": 1,
    "stream": False,
}
# Finish reasons that are not the model's choice: the engine stopped the call (a weight
# update's pause, ``/abort_requests``). Such a generation is never a turn's end.
ENGINE_STOPS = frozenset({"abort"})
# Pause modes the engines share (vLLM 0.32 ``/pause?mode=``); an adapter maps them to its own.
PAUSE_MODES = ("abort", "wait", "keep")
# What a streamed chat call asks for beside the ids: the usage chunk, for the count check.
STREAM_PARAMS: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
# Where each kind of problem is fixed, per family (``EngineAdapter.hints``): the probe's
# refusals name the setting.
HINT_KINDS = ("ids", "logprobs", "routes", "raw")


class ChatStream(Protocol):
    """A streamed chat reply read chunk by chunk: what each chunk adds for the harness, and
    the whole reply it adds up to, checked as a non-streamed reply is."""

    def add(self, chunk: Any) -> Delta: ...

    def response(self) -> dict[str, Any]: ...

    def unfinished(self) -> str | None:
        """Why the whole stream cannot be trusted (a broken chunk, no usage), or None."""
        ...


class IdsStream(Protocol):
    """A streamed token-in reply read event by event: the ids sampled so far (read when
    asked, so an engine that resends everything per event is parsed only then), and the
    whole reply it adds up to, checked as a non-streamed one is."""

    def add(self, data: str) -> None: ...

    def sampled(self) -> list[Any]: ...

    def response(self) -> dict[str, Any]: ...

    def unfinished(self) -> str | None: ...


class EngineAdapter(Protocol):
    """One engine family's wire: its request bodies, how its replies are read and checked,
    what it is asked once (as the worker starts), and where its settings are fixed."""

    name: str
    chat_path: str
    # What a request adds to get its routed experts back (``model_server.routed_experts``).
    routes_request: Mapping[str, Any]
    # The request field that leaves a prompt's first positions out of the routes returned
    # (vLLM 0.32's ``routed_experts_prompt_start``), or None where the engine has none.
    routes_start_field: str | None
    # The chat reply's top-level field of prompt ids, read off the reply's bytes
    # (``api.engine.reply_ids``), or None where the ids are elsewhere.
    prompt_ids_key: str | None
    # kind (``HINT_KINDS``) -> the engine setting that fixes that kind of problem.
    hints: Mapping[str, str]

    async def learn(self, ask: Ask, where: str) -> None:
        """Ask the engine, once, what changes how it is spoken to (vLLM: its release)."""
        ...

    def relays(self) -> bool:
        """Whether its chat stream carries every sampled id, so a streamed call can be
        relayed as it is sampled (else the call is made whole)."""
        ...

    def chat_body(
        self, chat_request: Mapping[str, Any], model: str, overrides: Mapping[str, Any]
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """The chat body sent upstream, and which sampling keys the overrides replaced."""
        ...

    def read_chat(
        self, response: Mapping[str, Any], overridden_keys: tuple[str, ...], vocab_size: int | None
    ) -> Generation: ...

    def chat_stream(self) -> ChatStream:
        """A reader of one streamed chat reply (only asked where ``relays()``)."""
        ...

    async def completed(
        self, generation: Generation, body: Mapping[str, Any], post: Post, vocab_size: int | None
    ) -> Generation:
        """The generation with what this engine's reply leaves out asked separately (a vLLM
        before 0.10.2: the prompt ids, from ``/tokenize``); others return it as it is."""
        ...

    async def tokenize(self, chat_request: Mapping[str, Any], model: str, post: Post) -> list[int]:
        """The prompt ids the engine renders for a chat request (``count_tokens``)."""
        ...

    def tokens_body(
        self, prompt_ids: list[int], model: str, sampling: Mapping[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """A token-in call: the path and body that continue exactly ``prompt_ids``."""
        ...

    def read_tokens(
        self, response: Mapping[str, Any], prompt_ids: list[int], vocab_size: int | None
    ) -> Generation: ...

    def relays_ids(self) -> bool:
        """Whether a token-in call can be streamed with every sampled id."""
        ...

    def tokens_stream(self, body: dict[str, Any]) -> IdsStream:
        """``body`` (of ``tokens_body``) made a streamed call, and the reader of its stream."""
        ...

    def read_routes(self, response: Mapping[str, Any], moe: Any) -> Routes | None: ...

    async def pause(self, command: Command, mode: str) -> None:
        """Stop the engine generating for a weight update (``PAUSE_MODES``); a ValueError
        names a mode this engine does not have."""
        ...

    async def resume(self, command: Command) -> None:
        """Let the engine generate again after a pause."""
        ...


def chat_body(
    params: Mapping[str, Any],
    chat_request: Mapping[str, Any],
    model: str,
    overrides: Mapping[str, Any],
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The chat request with an engine's capture ``params``, then ``sampling_overrides``.

    Returns the body and which sampling keys the overrides replaced or added. The body asks
    for a whole reply; a relayed call adds the stream's own parameters to it.
    """
    body = {**chat_request, "model": model, **params}
    body.pop("stream_options", None)
    body.update(overrides)
    return body, tuple(sorted(overrides))


def read_chat_reply(
    response: Mapping[str, Any],
    overridden_keys: tuple[str, ...],
    vocab_size: int | None,
    *,
    read_ids: Callable[[Mapping[str, Any]], ReadIds],
    prompt_ids: Callable[[Mapping[str, Any], Mapping[str, Any]], Any],
    stop_key: str,
    missing_prompt: str,
    check_prompt: bool = True,
) -> Generation:
    """A chat reply read the way every family reads one: its only choice, the generated
    ids and log-probs as the family finds them (``read_ids``), the prompt ids where the
    family puts them (``prompt_ids`` of the reply and its choice), then the shared checks. ``check_prompt`` False leaves a prompt the
    engine did not report for the caller to ask for (a vLLM before 0.10.2)."""
    choice, message = first_choice(response)
    ids, log_probs, problem = read_ids(choice)
    generation = reply_generation(
        response,
        message,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get(stop_key),
        prompt_ids=prompt_ids(response, choice),
        ids=ids,
        log_probs=log_probs,
        overridden_keys=overridden_keys,
    )
    if problem is None and check_prompt:
        packed, problem = prompt_check(
            generation.prompt_token_ids, generation.usage, vocab_size, missing=missing_prompt
        )
        generation = with_changes(generation, prompt_packed=packed)
    return finish(generation, problem, vocab_size)


async def tokenize(chat_request: Mapping[str, Any], model: str, post: Post) -> list[int]:
    """The prompt ids the engine's ``/tokenize`` renders for a chat request."""
    body: dict[str, Any] = {
        "model": chat_request.get("model") or model,
        "messages": chat_request.get("messages", []),
        "add_generation_prompt": True,
    }
    for key in ("tools", "chat_template_kwargs"):
        if chat_request.get(key):
            body[key] = chat_request[key]
    data = await post("/tokenize", body)
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise UpstreamError(502, "upstream /tokenize returned no token list")
    return tokens
