"""The SGLang adapter, following SGLang 0.5.23 (the release on PyPI).

Sources: ``python/sglang/srt/entrypoints/openai/protocol.py`` (``ChatCompletionRequest``
``return_token_ids`` and ``return_meta_info``; ``ChatCompletionResponseChoice``
``prompt_token_ids``, ``response_token_ids``, ``matched_stop``, ``meta_info``),
``serving_chat.py`` (how those are filled), and ``managers/io_struct.py`` (``GenerateReqInput``
for the native ``/generate``).

SGLang's ids are per choice: ``prompt_token_ids`` and ``response_token_ids`` (0.5.17 named the
latter ``token_ids``, so either is read). Its log-prob tokens are text, so the second id
source is ``meta_info.output_token_logprobs``: ``[logprob, id, text]`` per generated token
(``return_meta_info``); the two must agree, as vLLM's two sources must. A ``-inf`` log-prob
arrives as ``null`` and is missing, never a value. Ids are not sent on streams (SGLang refuses
the flags there), so every call is non-streamed. A token-in call is ``/generate`` with
``input_ids``, which returns ``output_ids`` and the same triples.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from api.engine import adapter
from api.engine.adapter import Ask, Command, Post
from api.engine.checks import finish, logprob_problem, sent_prompt_check, usable_logprobs
from api.engine.generation import Generation, reply_generation, with_changes
from api.engine.routes import flat_routes
from api.engine.sglang_stream import StreamedGenerate
from capture.routes import Routes

NAME = "sglang"
CHAT_PATH = "/v1/chat/completions"
TOKENS_PATH = "/generate"
CHAT_PARAMS: dict[str, Any] = {**adapter.CHAT_PARAMS, "return_meta_info": True}
NO_PROMPT_IDS = "the engine returned no prompt_token_ids although return_token_ids was requested"
NO_IDS = (
    "the engine returned no response_token_ids although return_token_ids was requested "
    "(SGLang >= 0.5.17 returns them)"
)
# What SGLang reports as its weight version until one is set (server_args.weight_version).
UNSET_WEIGHT_VERSION = "default"
# Sampling keys of a chat request and their /generate names.
_SAMPLING_NAMES = {"max_tokens": "max_new_tokens"}


# What a call asks for to get its routes back (the server also needs
# --enable-return-routed-experts).
ROUTES_REQUEST: dict[str, Any] = {"return_routed_experts": True}


def read_routes(response: Mapping[str, Any], moe: Any = None) -> Routes | None:
    """The routes in ``meta_info.routed_experts``: ``/generate``'s, or the chat choice's
    (with ``return_meta_info``, as tokcap asks; without it SGLang 0.5.23 puts them in the
    reply's ``sglext.routed_experts``, read too). Base64 of a flat int32 array, shaped by
    ``model_server.moe``; None when absent."""
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        choices = response.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        meta = choice.get("meta_info") if isinstance(choice, Mapping) else None
    data = meta.get("routed_experts") if isinstance(meta, Mapping) else None
    extension = response.get("sglext")
    if data is None and isinstance(extension, Mapping):
        data = extension.get("routed_experts")
    return flat_routes(data, moe)


def _triples(meta_info: Any) -> tuple[list[int] | None, list[Any] | None, str | None]:
    """Ids and values of ``meta_info.output_token_logprobs``, or why they cannot be read."""
    triples = meta_info.get("output_token_logprobs") if isinstance(meta_info, Mapping) else None
    if not isinstance(triples, list):
        return (
            None,
            None,
            (
                "the engine returned no meta_info.output_token_logprobs although return_meta_info "
                "and logprobs were requested (SGLang >= 0.5.13)"
            ),
        )
    if not all(isinstance(t, list) and len(t) >= 2 for t in triples):
        return None, None, "meta_info.output_token_logprobs holds an entry that is no triple"
    return [t[1] for t in triples], [t[0] for t in triples], None


def _values(values: list[Any]) -> tuple[list[float] | None, str | None]:
    """The log-probs as floats, or the first that is not usable."""
    usable = usable_logprobs(values)
    if usable is not None:
        return usable, None
    for position, value in enumerate(values):
        problem = logprob_problem(value)
        if problem is not None:
            return None, f"log-prob {position} {problem}"
    return [float(value) for value in values], None


def _chat_ids(choice: Mapping[str, Any]) -> tuple[list[int] | None, list[float] | None, str | None]:
    """The generated ids (response_token_ids, checked against the triples) and log-probs."""
    ids = choice.get("response_token_ids", choice.get("token_ids"))
    if ids is None:
        return None, None, NO_IDS
    triple_ids, triple_values, problem = _triples(choice.get("meta_info"))
    if problem is not None:
        return None, None, problem
    if triple_ids != ids:
        count = len(ids) if isinstance(ids, list) else "no list of"
        return (
            None,
            None,
            (
                f"response_token_ids ({count} ids) and meta_info.output_token_logprobs "
                f"({len(triple_ids or [])} ids) disagree"
            ),
        )
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list) or len(content) != len(ids):
        return None, None, "logprobs.content does not hold one entry per generated id"
    if [item.get("logprob") if isinstance(item, Mapping) else item for item in content] != (
        triple_values
    ):
        return None, None, "logprobs.content and meta_info.output_token_logprobs disagree"
    log_probs, problem = _values(triple_values or [])
    return (ids, log_probs, None) if problem is None else (None, None, problem)


def read_chat(
    response: Mapping[str, Any],
    overridden_keys: tuple[str, ...] = (),
    *,
    vocab_size: int | None = None,
) -> Generation:
    """Reduce a chat-completions response; ``ids_problem`` says why ids are unusable."""
    choices = response.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    meta = first.get("meta_info") if isinstance(first, Mapping) else None
    generation = adapter.read_chat_reply(
        response,
        overridden_keys,
        vocab_size,
        read_ids=_chat_ids,
        prompt_ids=lambda reply, choice: choice.get("prompt_token_ids"),
        stop_key="matched_stop",
        missing_prompt=NO_PROMPT_IDS,
    )
    return with_changes(generation, policy_version=weight_version(meta))


def weight_version(meta: Any) -> str | None:
    """The weights' version SGLang reports in ``meta_info`` (``--weight-version``,
    ``/update_weight_version``); None for its unset default, ``"default"``."""
    version = meta.get("weight_version") if isinstance(meta, Mapping) else None
    return None if version in (None, "", UNSET_WEIGHT_VERSION) else str(version)


def tokens_body(
    prompt_ids: list[int], model: str, sampling: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """A token-in call: ``/generate`` with ``input_ids``, log-probs of the output only."""
    params = {_SAMPLING_NAMES.get(key, key): value for key, value in sampling.items()}
    params.setdefault("skip_special_tokens", False)
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": params,
        "return_logprob": True,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }
    return TOKENS_PATH, body


def read_tokens(
    response: Mapping[str, Any], prompt_ids: list[int], vocab_size: int | None = None
) -> Generation:
    """Reduce a ``/generate`` reply; the counts it reports must match what was sent and got."""
    meta = response.get("meta_info") if isinstance(response.get("meta_info"), Mapping) else {}
    ids = response.get("output_ids")
    triple_ids, triple_values, problem = _triples(meta)
    if problem is None and triple_ids != ids:
        problem = "output_ids and meta_info.output_token_logprobs disagree"
    log_probs, value_problem = _values(triple_values or []) if problem is None else (None, None)
    finish_reason = meta.get("finish_reason")
    reason = finish_reason if isinstance(finish_reason, Mapping) else {}
    usage = {key: meta[key] for key in ("prompt_tokens", "completion_tokens") if key in meta}
    generation = reply_generation(
        response,
        {"role": "assistant", "content": str(response.get("text") or "")},
        finish_reason=reason.get("type"),
        stop_reason=reason.get("matched"),
        prompt_ids=list(prompt_ids),
        ids=ids if isinstance(ids, list) else None,
        log_probs=log_probs,
        usage=usage,
    )
    problem = problem or value_problem
    if problem is None:
        packed, problem = sent_prompt_check(prompt_ids, usage)
        generation = with_changes(generation, prompt_packed=packed)
    generation = with_changes(generation, policy_version=weight_version(meta))
    return finish(generation, problem, vocab_size)


HINTS = {
    "ids": "run SGLang >= 0.5.17 (return_token_ids, return_meta_info)",
    "logprobs": "SGLang must return log-probs (return_logprob; do not disable it)",
    "routes": "start SGLang with --enable-return-routed-experts and give model_server.moe "
    "(layers, top_k), or turn routed_experts off",
    "raw": "SGLang returns log-probs before temperature here; use temperature 1.0",
}


class SGLang:
    """The SGLang adapter (``api.engine.adapter.EngineAdapter``). Nothing learned at the
    first call changes how it is spoken to. Its chat stream carries no ids, so a streamed
    text-mode call is made whole; a token-in call (faithful prompts) streams its ids."""

    name = NAME
    chat_path = CHAT_PATH
    routes_request = ROUTES_REQUEST
    routes_start_field = None  # SGLang 0.5.23 returns every position's routes
    prompt_ids_key = None  # per choice, not at the top level
    hints = HINTS

    async def learn(self, ask: Ask, where: str) -> None:
        return None

    def relays(self) -> bool:
        return False

    def read_chat(
        self, response: Mapping[str, Any], overridden_keys: tuple[str, ...], vocab_size: int | None
    ) -> Generation:
        return read_chat(response, overridden_keys, vocab_size=vocab_size)

    def chat_stream(self) -> adapter.ChatStream:
        raise NotImplementedError("SGLang's chat stream carries no ids: calls are made whole")

    def relays_ids(self) -> bool:
        """``/generate`` streams carry every id (``api.engine.sglang_stream``)."""
        return True

    def tokens_stream(self, body: dict[str, Any]) -> StreamedGenerate:
        body["stream"] = True
        return StreamedGenerate()

    async def completed(
        self, generation: Generation, body: Mapping[str, Any], post: Post, vocab_size: int | None
    ) -> Generation:
        return generation

    # The module's own bodies and readers, as they are: they need nothing learned of the engine.
    chat_body = staticmethod(functools.partial(adapter.chat_body, CHAT_PARAMS))
    tokenize = staticmethod(adapter.tokenize)
    tokens_body = staticmethod(tokens_body)
    read_tokens = staticmethod(read_tokens)
    read_routes = staticmethod(read_routes)

    async def pause(self, command: Command, mode: str) -> None:
        """SGLang's ``POST /pause_generation`` (``http_server.py``): its ``abort`` mode is
        vLLM's; ``in_place`` keeps requests as vLLM's ``keep`` does; it has no ``wait``."""
        modes = {"abort": "abort", "keep": "in_place"}
        if mode not in modes:
            raise ValueError(f"SGLang pauses with mode {', '.join(modes)}, not {mode!r}")
        await command("/pause_generation", {"mode": modes[mode]})

    async def resume(self, command: Command) -> None:
        await command("/continue_generation", {})
