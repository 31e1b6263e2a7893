"""The client of the upstream engine (vLLM >= 0.10.2 or the tokcap engine).

Every model call becomes exactly one non-streamed chat-completions request that asks for the
ids twice: ``return_token_ids`` (top-level ``prompt_token_ids``, per-choice ``token_ids``) and
``logprobs`` with ``return_tokens_as_token_ids`` (``"token_id:N"`` tokens). The two sources
must agree, or the ids are not trusted. ``sampling_overrides`` are applied last, whatever the
harness sent.

The reply is checked before anything is captured, against the shapes of vLLM 0.10.2
(``vllm/entrypoints/openai/protocol.py``, ``serving_chat.py``); a failed check is the call's
``ids_problem``, which marks the rollout incomplete while the harness is still served:

- the id counts equal ``usage.prompt_tokens`` and ``usage.completion_tokens`` when the engine
  reports them (vLLM counts ``len(prompt_token_ids)`` and ``len(output.token_ids)``, the
  end-of-sequence id included, as ``token_ids`` does);
- ``token_ids`` and ``prompt_token_ids`` are present. An engine that predates them (vLLM
  before 0.10.2, known from ``GET /version`` once per client) gives the generated ids through
  the log-probs alone and its prompt ids through ``/tokenize``; no other engine may;
- each log-prob is a JSON number, finite and <= 0; vLLM writes ``-9999.0`` where it has none
  (``ChatCompletionLogProb.logprob``'s default, and ``-inf`` clamped), so that is missing;
- a reply that served text, reasoning or a tool call has generated ids;
- ids are integers >= 0, below the vocabulary size when it is configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from api import jsonbytes

log = logging.getLogger(__name__)

# What every upstream call asks for; the id capture depends on these.
CAPTURE_PARAMS: dict[str, Any] = {
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "n": 1,
    "stream": False,
}
TOKEN_ID_PREFIX = "token_id:"
JSON_HEADERS = {"content-type": "application/json"}
# httpx's default pool size, with every connection kept alive: concurrent calls of a harness
# fleet reuse warm connections instead of reconnecting beyond httpx's default of 20 idle ones.
MAX_CONNECTIONS = 100
# uvicorn, which serves vLLM and SGLang, closes a connection idle for 5 s; a pooled one kept
# as long can be closed just as a request goes out on it. Expire ours well before that.
KEEPALIVE_EXPIRY_S = 2.0
# The first vLLM release that answers return_token_ids (prompt_token_ids, token_ids).
TOKEN_IDS_SINCE = (0, 10, 2)
# What vLLM writes for a log-prob it does not have (and for -inf, clamped).
LOGPROB_PLACEHOLDER = -9999.0
_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")
# /version is trivial to serve; a slow answer must not hold the first call for long.
VERSION_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


class UpstreamError(Exception):
    """The upstream returned no usable output; ``status`` is what the harness is told."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Generation:
    """One upstream completion, reduced to what the capture and reply steps read."""

    response: dict[str, Any]
    message: dict[str, Any]
    finish_reason: str | None
    stop_reason: Any
    prompt_token_ids: list[int] | None
    generation_token_ids: list[int] | None
    generation_log_probs: list[float] | None
    # Why the ids cannot be captured (None when they can).
    ids_problem: str | None
    overridden_keys: tuple[str, ...] = ()
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        content = self.message.get("content")
        return content if isinstance(content, str) else ""

    @property
    def reasoning(self) -> str:
        # vLLM 0.10 names it reasoning_content; later versions name it reasoning.
        value = self.message.get("reasoning_content") or self.message.get("reasoning")
        return value if isinstance(value, str) else ""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        calls = self.message.get("tool_calls") or []
        return [call for call in calls if isinstance(call, Mapping)]

    @property
    def prompt_tokens(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)


def upstream_request(
    chat_request: Mapping[str, Any], model: str, overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The body sent upstream, and which sampling keys the overrides replaced or added."""
    body = {**chat_request, "model": model, **CAPTURE_PARAMS}
    body.pop("stream_options", None)
    body.update(overrides)
    return body, tuple(sorted(overrides))


def engine_predates_token_ids(version: Any) -> bool:
    """Whether a ``GET /version`` answer names a vLLM before 0.10.2 (no ``return_token_ids``).

    Only the release numbers count, so a 0.10.2 pre-release or dev build is modern: if it
    lacks the fields its calls are marked incomplete, never captured from ``/tokenize``. A
    version that cannot be read is modern for the same reason.
    """
    match = _RELEASE.match(version) if isinstance(version, str) else None
    if match is None:
        return False
    release = tuple(int(part or 0) for part in match.groups())
    return release < TOKEN_IDS_SINCE


def _token_id(item: Any) -> int | None:
    """N of a ``"token_id:N"`` log-prob token; None for anything else (strictly digits)."""
    token = item.get("token") if isinstance(item, Mapping) else None
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        return None
    digits = token[len(TOKEN_ID_PREFIX) :]
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _logprob_problem(item: Mapping[str, Any]) -> str | None:
    """Why one log-prob is not a usable value; float() alone would accept "-0.5" or NaN."""
    if "logprob" not in item:
        return "is missing"
    value = item["logprob"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a JSON number"
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        finite = False
    if not finite:
        return f"is {value!r}, not finite"
    if value == LOGPROB_PLACEHOLDER:
        return "is vLLM's placeholder -9999.0: the engine had no log-prob for this step"
    if value > 0:
        return f"is {value!r}; a log-probability is at most 0"
    return None


def _logprob_ids(
    choice: Mapping[str, Any],
) -> tuple[list[int] | None, list[float] | None, str | None]:
    """The generated ids and log-probs read from the ``token_id:N`` log-prob entries."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list):
        return None, None, "upstream returned no log-probs"
    ids: list[int] = []
    values: list[float] = []
    for position, item in enumerate(content):
        token_id = _token_id(item)
        if token_id is None:
            token = item.get("token") if isinstance(item, Mapping) else item
            return None, None, f"log-prob token {position} is {token!r}, not 'token_id:N'"
        problem = _logprob_problem(item)
        if problem is not None:
            return None, None, f"log-prob {position} (token_id:{token_id}) {problem}"
        ids.append(token_id)
        values.append(float(item["logprob"]))
    return ids, values, None


def _bad_id(what: str, ids: list[Any], vocab_size: int | None) -> str | None:
    """Why a list of ids holds something that is no token; a C-speed pass for the good case."""
    if list(map(type, ids)).count(int) == len(ids) and (
        not ids or (min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size))
    ):
        return None
    for position, token_id in enumerate(ids):
        if type(token_id) is not int or token_id < 0:
            return f"{what} id {position} is {token_id!r}, not an integer >= 0"
        if vocab_size is not None and token_id >= vocab_size:
            return (
                f"{what} id {position} is {token_id}, not below the vocabulary size "
                f"{vocab_size} (model_server.vocab_size)"
            )
    return None


def _count_problem(what: str, count: int, usage: Mapping[str, Any], key: str) -> str | None:
    """The engine's own count disagrees with the ids it returned: they were cut or shifted."""
    reported = usage.get(key)
    if reported is None:
        return None  # this engine does not report usage
    if type(reported) is not int:
        return f"usage.{key} is {reported!r}, not an integer"
    if reported != count:
        return (
            f"the engine returned {count} {what} ids but counted usage.{key}={reported}; "
            "the ids are not the sequence it processed"
        )
    return None


def prompt_problem(ids: Any, usage: Mapping[str, Any], vocab_size: int | None = None) -> str | None:
    """Why prompt ids cannot be trusted (from the reply or from ``/tokenize``), or None."""
    if ids is None:
        return (
            "the engine returned no prompt_token_ids although return_token_ids was requested "
            "(vLLM >= 0.10.2 returns them; an older engine must say so at GET /version)"
        )
    if not isinstance(ids, list):
        return "prompt_token_ids is not a list"
    if not ids:
        return "prompt_token_ids is empty; a rendered chat prompt has tokens"
    return _bad_id("prompt", ids, vocab_size) or _count_problem(
        "prompt", len(ids), usage, "prompt_tokens"
    )


def _token_ids_problem(token_ids: Any, ids: list[int], legacy: bool) -> str | None:
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


def _served(generation: Generation) -> str:
    """What the harness is shown of a generation, named for a message ('' for nothing)."""
    shown = [
        name
        for name, present in (
            ("text", generation.text),
            ("reasoning", generation.reasoning),
            ("a tool call", generation.tool_calls),
        )
        if present
    ]
    return " and ".join(shown)


def _generation_problem(generation: Generation, vocab_size: int | None) -> str | None:
    """Generated ids in the vocabulary, present for what was served, and as many as counted."""
    ids = generation.generation_token_ids or []
    problem = _bad_id("generated", ids, vocab_size)
    if problem is None and not ids and _served(generation):
        problem = (
            f"the engine returned no generated ids but served {_served(generation)}; "
            "what the harness was told has no tokens to train on"
        )
    return problem or _count_problem("generated", len(ids), generation.usage, "completion_tokens")


def _first_choice(response: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The only choice and its message; without them nothing can be served (502)."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamError(502, "upstream answered without a choice")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, Mapping):
        raise UpstreamError(502, "upstream choice has no message")
    return choice, message


def read_generation(
    response: Mapping[str, Any],
    overridden_keys: tuple[str, ...] = (),
    *,
    legacy: bool = False,
    vocab_size: int | None = None,
) -> Generation:
    """Reduce a chat-completions response; ``ids_problem`` says why ids are unusable.

    ``legacy`` (an engine before vLLM 0.10.2) lets ``token_ids`` and ``prompt_token_ids`` be
    absent; the prompt ids are then None for the caller to read from ``/tokenize`` and check
    with ``prompt_problem``. Every other check of the module docstring is made here.
    """
    choice, message = _first_choice(response)
    ids, log_probs, problem = _logprob_ids(choice)
    usage = response.get("usage")
    generation = Generation(
        response=dict(response),
        message=dict(message),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=response.get("prompt_token_ids"),
        generation_token_ids=ids,
        generation_log_probs=log_probs,
        ids_problem=None,
        overridden_keys=overridden_keys,
        usage=dict(usage) if isinstance(usage, Mapping) else {},
    )
    problem = problem or _token_ids_problem(choice.get("token_ids"), ids or [], legacy)
    problem = problem or _generation_problem(generation, vocab_size)
    if problem is None and not (legacy and generation.prompt_token_ids is None):
        problem = prompt_problem(generation.prompt_token_ids, generation.usage, vocab_size)
    return generation if problem is None else _with(generation, ids_problem=problem)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return json.dumps(body)[:500]


class UpstreamClient:
    """One connection pool to the engine per worker.

    Whether the engine predates ``return_token_ids`` is asked once, at the first model call,
    from ``GET /version`` (vLLM's ``{"version": "0.10.2"}``), and kept for the client's life.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        timeout_s: float = 600.0,
        vocab_size: int | None = None,
    ) -> None:
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer or None, not {vocab_size}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._served_model: str | None = None  # the upstream's first model, once asked
        self.sampling_overrides = dict(sampling_overrides or {})
        self.vocab_size = vocab_size
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS,
                max_keepalive_connections=MAX_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )
        self._urls: dict[str, httpx.URL] = {}
        self._legacy: bool | None = None  # None: not asked yet (or the engine did not answer)
        self._legacy_lock = asyncio.Lock()

    def _url(self, path: str) -> httpx.URL:
        # httpx parses a relative URL again on every request; each path is merged once.
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self._http.build_request("POST", path).url
        return url

    async def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        content = jsonbytes.dumps(body)  # ValueError for NaN, as httpx's json= raised
        try:
            try:
                response = await self._http.post(
                    self._url(path), content=content, headers=JSON_HEADERS
                )
            except httpx.RemoteProtocolError:
                # The engine closed a pooled connection as the request went out, and answered
                # nothing: send it once more. A sample it may have drawn was never returned,
                # so nothing of it reaches the harness or the capture.
                response = await self._http.post(
                    self._url(path), content=content, headers=JSON_HEADERS
                )
        except httpx.HTTPError as exc:
            raise UpstreamError(
                502, f"upstream {self.base_url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if response.status_code >= 400:
            # The harness may fix a 4xx itself; a 5xx is the upstream's fault: a bad gateway.
            status = response.status_code if response.status_code < 500 else 502
            raise UpstreamError(status, f"upstream: {_error_message(response)}")
        try:
            data = jsonbytes.loads(response.content)
        except ValueError as exc:
            raise UpstreamError(502, "upstream answered with invalid JSON") from exc
        if not isinstance(data, dict):
            raise UpstreamError(502, "upstream answered with a non-object JSON body")
        return data

    async def models(self) -> list[dict[str, Any]]:
        try:
            response = await self._http.get("/v1/models")
            response.raise_for_status()
            data = response.json().get("data", [])
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise UpstreamError(502, f"upstream models unavailable: {exc}") from exc
        return [item for item in data if isinstance(item, Mapping) and item.get("id")]

    async def model_name(self, requested: Any) -> str:
        """The configured model, else the upstream's first, else what the harness named.

        The upstream's answer is kept apart from the configured ``model``, which stays as
        it was set.
        """
        if self.model is not None:
            return self.model
        if self._served_model is None:
            try:
                models = await self.models()
            except UpstreamError:
                models = []
            if models:
                self._served_model = str(models[0]["id"])
        if self._served_model is not None:
            return self._served_model
        return requested if isinstance(requested, str) else ""

    async def legacy_engine(self) -> bool:
        """Whether the engine is a vLLM before 0.10.2; asked once, concurrent callers wait."""
        if self._legacy is None:
            async with self._legacy_lock:
                if self._legacy is None:
                    self._legacy = await self._ask_version()
        return bool(self._legacy)

    async def _ask_version(self) -> bool | None:
        """The engine's era from ``GET /version``; None when it was unreachable (ask again).

        Any HTTP answer decides: one without a readable version (404, an error) is modern.
        Until an answer, the engine counts as modern too: a legacy engine's call is then
        marked incomplete for its missing fields, never captured from an unreported prompt.
        """
        try:
            response = await self._http.get("/version", timeout=VERSION_TIMEOUT)
        except httpx.HTTPError:
            return None
        try:
            version = response.json().get("version") if response.status_code < 400 else None
        except (ValueError, AttributeError):
            version = None
        legacy = engine_predates_token_ids(version)
        if legacy:
            log.warning(
                "engine %s reports version %s, before vLLM 0.10.2: generated ids come from the "
                "log-prob tokens alone and prompt ids from /tokenize",
                self.base_url,
                version,
            )
        return legacy

    async def chat(self, chat_request: Mapping[str, Any]) -> Generation:
        """One upstream call, checked; a legacy engine's prompt ids come from ``/tokenize``."""
        model = await self.model_name(chat_request.get("model"))
        legacy = await self.legacy_engine()
        body, overridden = upstream_request(chat_request, model, self.sampling_overrides)
        response = await self._post("/v1/chat/completions", body)
        generation = read_generation(
            response, overridden, legacy=legacy, vocab_size=self.vocab_size
        )
        if legacy and generation.ids_problem is None and generation.prompt_token_ids is None:
            return await self._with_tokenized_prompt(generation, body)
        return generation

    async def _with_tokenized_prompt(
        self, generation: Generation, body: Mapping[str, Any]
    ) -> Generation:
        """The generation with the prompt ids ``/tokenize`` renders, checked like the reply's."""
        try:
            prompt_ids = await self.tokenize(body)
        except UpstreamError as exc:
            return _with(generation, ids_problem=f"no prompt ids: {exc.message}")
        problem = prompt_problem(prompt_ids, generation.usage, self.vocab_size)
        if problem is not None:
            return _with(generation, ids_problem=f"/tokenize: {problem}")
        return _with(generation, prompt_token_ids=prompt_ids)

    async def tokenize(self, chat_request: Mapping[str, Any]) -> list[int]:
        """The prompt ids of a chat request, rendered by the upstream (messages form)."""
        body: dict[str, Any] = {
            "model": chat_request.get("model") or await self.model_name(None),
            "messages": chat_request.get("messages", []),
            "add_generation_prompt": True,
        }
        for key in ("tools", "chat_template_kwargs"):
            if chat_request.get(key):
                body[key] = chat_request[key]
        data = await self._post("/tokenize", body)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise UpstreamError(502, "upstream /tokenize returned no token list")
        return tokens

    async def close(self) -> None:
        await self._http.aclose()


def _with(generation: Generation, **changes: Any) -> Generation:
    """A copy with ``changes``; a problem voids all three arrays, so none is half-trusted."""
    if "ids_problem" in changes:
        changes.update(prompt_token_ids=None, generation_token_ids=None, generation_log_probs=None)
    return replace(generation, **changes)
