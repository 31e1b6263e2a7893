"""The vLLM adapter, following vLLM 0.10.2's OpenAI-compatible server.

Sources: ``vllm/entrypoints/openai/protocol.py`` (``ChatCompletionRequest.return_token_ids``,
``ChatCompletionResponse.prompt_token_ids``, ``ChatCompletionResponseChoice.token_ids``,
``ChatCompletionLogProb.logprob = -9999.0``, ``CompletionResponseChoice``) and
``serving_chat.py`` / ``serving_completion.py`` of the v0.10.2 tag.

A chat call asks for the ids twice: ``return_token_ids`` (top-level ``prompt_token_ids``,
per-choice ``token_ids``) and ``logprobs`` with ``return_tokens_as_token_ids``
(``"token_id:N"`` tokens); the two must agree. vLLM writes ``-9999.0`` for a log-prob it does
not have (and for ``-inf``, clamped), so that value is missing, never a real one. An engine
before 0.10.2 (known from ``GET /version``) has no ``token_ids``: its generated ids come from
the log-prob tokens alone and its prompt ids from ``/tokenize``; no other engine may do that.
A token-in call is ``/v1/completions`` with the prompt as ids; there both arrays are per
choice, and the log-probs are the legacy ``tokens`` / ``token_logprobs`` lists.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
from collections.abc import Mapping
from typing import Any

from api.engine import adapter
from api.engine.adapter import PAUSE_MODES, Ask, Command, Post
from api.engine.checks import (
    finish,
    logprob_problem,
    prompt_check,
    sent_prompt_check,
    usable_logprobs,
)
from api.engine.generation import (
    Generation,
    UpstreamError,
    reply_generation,
    with_changes,
)
from api.engine.vllm_stream import RELAY_SINCE, StreamedChat, StreamedCompletion
from capture.routes import Routes, routes_from_npy

log = logging.getLogger(__name__)

NAME = "vllm"
CHAT_PATH = "/v1/chat/completions"
TOKENS_PATH = "/v1/completions"
# What every chat call asks for; the id capture depends on these.
CHAT_PARAMS: dict[str, Any] = {**adapter.CHAT_PARAMS, "return_tokens_as_token_ids": True}
TOKEN_ID_PREFIX = "token_id:"
# Every token of a reply joined by commas: "token_id:" and ASCII digits, each (as _token_id).
_TOKEN_IDS = re.compile(r"token_id:[0-9]+(?:,token_id:[0-9]+)*")
_TOKEN, _LOGPROB = operator.itemgetter("token"), operator.itemgetter("logprob")
# What vLLM writes for a log-prob it does not have (and for -inf, clamped).
LOGPROB_PLACEHOLDER = -9999.0
# The first vLLM release that answers return_token_ids (prompt_token_ids, token_ids).
TOKEN_IDS_SINCE = (0, 10, 2)
_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")
NO_PROMPT_IDS = (
    "the engine returned no prompt_token_ids although return_token_ids was requested "
    "(vLLM >= 0.10.2 returns them; an older engine must say so at GET /version)"
)


# What a call asks for to get its routes back: nothing, vLLM sends them whenever it was
# started with --enable-return-routed-experts.
ROUTES_REQUEST: dict[str, Any] = {}


def read_routes(response: Mapping[str, Any], moe: Any = None) -> Routes | None:
    """The routes of the reply's choice (vLLM 0.32 ``CompletionResponseChoice`` and
    ``ChatCompletionResponseChoice.routed_experts``: a base64 ``.npy``), or None."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    data = choice.get("routed_experts") if isinstance(choice, Mapping) else None
    return None if data is None else routes_from_npy(data)


def release_of(version: Any) -> tuple[int, ...] | None:
    """The release numbers of a ``GET /version`` answer ("0.12.1rc2" -> (0, 12, 1))."""
    match = _RELEASE.match(version) if isinstance(version, str) else None
    return tuple(int(part or 0) for part in match.groups()) if match else None


def predates_token_ids(version: Any) -> bool:
    """Whether a ``GET /version`` answer names a vLLM before 0.10.2 (no ``return_token_ids``).

    Only the release numbers count, so a 0.10.2 pre-release or dev build is modern: if it
    lacks the fields its calls are marked incomplete, never captured from ``/tokenize``. A
    version that cannot be read is modern for the same reason.
    """
    release = release_of(version)
    return release is not None and release < TOKEN_IDS_SINCE


def _token_id(token: Any) -> int | None:
    """N of a ``"token_id:N"`` log-prob token; None for anything else (strictly digits)."""
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        return None
    digits = token[len(TOKEN_ID_PREFIX) :]
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _value_problem(value: Any) -> str | None:
    if value is None:  # vLLM never writes null for a chat log-prob (it writes -9999.0)
        return "is None, not a JSON number"
    if value == LOGPROB_PLACEHOLDER:
        return "is vLLM's placeholder -9999.0: the engine had no log-prob for this step"
    return logprob_problem(value)


def _token_ids(tokens: list[Any]) -> list[int] | None:
    """N of every ``token_id:N`` token, in one pattern match over them all; None when any
    token is something else (``_token_id`` then names it)."""
    if not set(map(type, tokens)) <= {str}:
        return None
    joined = ",".join(tokens)
    if _TOKEN_IDS.fullmatch(joined) is None:
        return None
    ids = list(map(int, joined.replace(TOKEN_ID_PREFIX, "").split(",")))
    return ids if len(ids) == len(tokens) else None  # a token held a comma of its own


def _read_logprobs(
    tokens: list[Any], values: list[Any]
) -> tuple[list[int] | None, list[float] | None, str | None]:
    """Ids and log-probs from ``token_id:N`` tokens and their values, or why not: all at
    once in the usual case, else position by position to name the first problem."""
    fast_ids, fast_values = _token_ids(tokens), usable_logprobs(values, LOGPROB_PLACEHOLDER)
    if fast_ids is not None and fast_values is not None:
        return fast_ids, fast_values, None
    return _read_one_by_one(tokens, values)


def _read_one_by_one(
    tokens: list[Any], values: list[Any]
) -> tuple[list[int] | None, list[float] | None, str | None]:
    ids: list[int] = []
    for position, (token, value) in enumerate(zip(tokens, values, strict=True)):
        token_id = _token_id(token)
        if token_id is None:
            return None, None, f"log-prob token {position} is {token!r}, not 'token_id:N'"
        problem = _value_problem(value)
        if problem is not None:
            return None, None, f"log-prob {position} (token_id:{token_id}) {problem}"
        ids.append(token_id)
    return ids, [float(value) for value in values], None


def _chat_logprobs(
    choice: Mapping[str, Any],
) -> tuple[list[int] | None, list[float] | None, str | None]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list):
        return None, None, "upstream returned no log-probs"
    try:  # every entry an object with both fields: read at C speed
        tokens, values = list(map(_TOKEN, content)), list(map(_LOGPROB, content))
    except (KeyError, TypeError):
        if not all(isinstance(item, Mapping) for item in content):
            return None, None, "a log-prob entry is not an object"
        tokens = [item.get("token") for item in content]
        values = [item.get("logprob", "missing") for item in content]
        if "missing" in values:
            return None, None, f"log-prob {values.index('missing')} is missing"
    return _read_logprobs(tokens, values)


def _both_sources(token_ids: Any, ids: list[int], legacy: bool) -> str | None:
    """Both id sources present and equal; only an engine before 0.10.2 may lack token_ids."""
    if token_ids is None:
        if legacy:
            return None
        return (
            "the engine returned log-prob ids but no token_ids although return_token_ids was "
            "requested; the log-prob tokens alone are not trusted"
        )
    if token_ids != ids:
        count = len(token_ids) if isinstance(token_ids, list) else "no list of"
        return f"token_ids ({count} ids) and the log-prob tokens ({len(ids)} ids) disagree"
    return None


def read_chat(
    response: Mapping[str, Any],
    overridden_keys: tuple[str, ...] = (),
    *,
    legacy: bool = False,
    vocab_size: int | None = None,
) -> Generation:
    """Reduce a chat-completions response; ``ids_problem`` says why ids are unusable.

    ``legacy`` (an engine before vLLM 0.10.2) lets ``token_ids`` and ``prompt_token_ids`` be
    absent; the prompt ids are then None for the caller to read from ``/tokenize``.
    """

    def read_ids(choice: Mapping[str, Any]) -> adapter.ReadIds:
        ids, log_probs, problem = _chat_logprobs(choice)
        problem = problem or _both_sources(choice.get("token_ids"), ids or [], legacy)
        return ids, log_probs, problem

    return adapter.read_chat_reply(
        response,
        overridden_keys,
        vocab_size,
        read_ids=read_ids,
        prompt_ids=lambda reply, choice: reply.get("prompt_token_ids"),
        stop_key="stop_reason",
        missing_prompt=NO_PROMPT_IDS,
        check_prompt=not (legacy and response.get("prompt_token_ids") is None),
    )


def tokens_body(
    prompt_ids: list[int], model: str, sampling: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """A token-in call: ``/v1/completions`` with the prompt as ids, asking for the ids back."""
    body = {
        "model": model,
        "prompt": list(prompt_ids),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "n": 1,
        "stream": False,
        **sampling,
    }
    return TOKENS_PATH, body


def read_tokens(
    response: Mapping[str, Any], prompt_ids: list[int], vocab_size: int | None = None
) -> Generation:
    """Reduce a token-in completion; its prompt ids must be exactly the ones sent."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamError(502, "upstream answered without a choice")
    choice = choices[0]
    logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), Mapping) else {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        ids, log_probs, problem = None, None, "upstream returned no log-probs"
    else:
        ids, log_probs, problem = _read_logprobs(tokens, values)
    generation = reply_generation(
        response,
        {"role": "assistant", "content": str(choice.get("text") or "")},
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_ids=list(prompt_ids),
        ids=ids,
        log_probs=log_probs,
    )
    problem = problem or _both_sources(choice.get("token_ids"), ids or [], legacy=False)
    if problem is None and choice.get("prompt_token_ids") != prompt_ids:
        problem = "the engine's prompt_token_ids are not the prompt ids sent"
    if problem is None:
        packed, problem = sent_prompt_check(prompt_ids, generation.usage)
        generation = with_changes(generation, prompt_packed=packed)
    return finish(generation, problem, vocab_size)


HINTS = {
    "ids": "run vLLM >= 0.10.2 (return_token_ids); an older vLLM must answer GET /version",
    "logprobs": "vLLM must allow log-probs (--max-logprobs >= 1)",
    "routes": "start vLLM with --enable-return-routed-experts, or turn routed_experts off",
    "raw": "start vLLM with --logprobs-mode processed_logprobs (vLLM >= 0.10.2)",
}


class VLLM:
    """The vLLM adapter (``api.engine.adapter.EngineAdapter``): what it learned of one
    engine's release, and the module's readers bound to it."""

    name = NAME
    chat_path = CHAT_PATH
    routes_request = ROUTES_REQUEST
    # vLLM 0.32 ``SamplingParams.routed_experts_prompt_start`` (on its completion request):
    # the routes cover positions [start, tokens - 1); 0 <= start <= the prompt's length.
    routes_start_field = "routed_experts_prompt_start"
    prompt_ids_key = "prompt_token_ids"  # ChatCompletionResponse's, top level
    hints = HINTS

    def __init__(self) -> None:
        # Whether the engine predates return_token_ids; None until it answered GET /version.
        # Until then it counts as modern: a legacy engine's call is then marked incomplete
        # for its missing fields, never captured from an unreported prompt.
        self.legacy: bool | None = None
        self.release: tuple[int, ...] | None = None

    async def learn(self, ask: Ask, where: str) -> None:
        """The engine's release from ``GET /version``. Any HTTP answer decides: one without a
        readable version (404, an error) is modern; no answer leaves it to the next call."""
        status, body = await ask("/version")
        if not status:
            return
        version = body.get("version") if status < 400 and isinstance(body, Mapping) else None
        self.release = release_of(version)
        self.legacy = predates_token_ids(version)
        if self.legacy:
            log.warning(
                "engine %s reports version %s, before vLLM 0.10.2: generated ids come from the "
                "log-prob tokens alone and prompt ids from /tokenize",
                where,
                version,
            )

    def relays(self) -> bool:
        return self.release is not None and self.release >= RELAY_SINCE

    def read_chat(
        self, response: Mapping[str, Any], overridden_keys: tuple[str, ...], vocab_size: int | None
    ) -> Generation:
        return read_chat(response, overridden_keys, legacy=bool(self.legacy), vocab_size=vocab_size)

    def chat_stream(self) -> StreamedChat:
        return StreamedChat()

    def relays_ids(self) -> bool:
        """A release known to return ``token_ids`` (0.10.2 on) streams them per chunk."""
        return self.legacy is False

    def tokens_stream(self, body: dict[str, Any]) -> StreamedCompletion:
        body.update(adapter.STREAM_PARAMS)
        return StreamedCompletion()

    async def completed(
        self, generation: Generation, body: Mapping[str, Any], post: Post, vocab_size: int | None
    ) -> Generation:
        """A legacy engine's prompt ids, rendered by its ``/tokenize`` and checked like the
        reply's; any other reply as it is."""
        if not self.legacy or generation.ids_problem is not None:
            return generation
        if generation.prompt_token_ids is not None:
            return generation
        try:
            prompt_ids = await adapter.tokenize(body, str(body.get("model") or ""), post)
        except UpstreamError as exc:
            return with_changes(generation, ids_problem=f"no prompt ids: {exc.message}")
        packed, problem = prompt_check(prompt_ids, generation.usage, vocab_size)
        if problem is not None:
            return with_changes(generation, ids_problem=f"/tokenize: {problem}")
        return with_changes(generation, prompt_token_ids=prompt_ids, prompt_packed=packed)

    # The module's own bodies and readers, as they are: they need nothing learned of the engine.
    chat_body = staticmethod(functools.partial(adapter.chat_body, CHAT_PARAMS))
    tokenize = staticmethod(adapter.tokenize)
    tokens_body = staticmethod(tokens_body)
    read_tokens = staticmethod(read_tokens)
    read_routes = staticmethod(read_routes)

    async def pause(self, command: Command, mode: str) -> None:
        """vLLM 0.32's ``POST /pause?mode=`` (``vllm/entrypoints/rl/online/api_router.py``,
        served with ``VLLM_SERVER_DEV_MODE=1``): abort, wait or keep, as asked."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"vLLM pauses with mode {', '.join(PAUSE_MODES)}, not {mode!r}")
        await command(f"/pause?mode={mode}", None)

    async def resume(self, command: Command) -> None:
        await command("/resume", None)
