"""The client of the upstream engine (vLLM >= 0.10.2 or the tokcap engine).

Every model call becomes exactly one non-streamed chat-completions request that asks for the
ids twice: ``return_token_ids`` (top-level ``prompt_token_ids``, per-choice ``token_ids``) and
``logprobs`` with ``return_tokens_as_token_ids`` (``"token_id:N"`` tokens). The two sources
must agree, or the ids are not trusted. An upstream that predates ``return_token_ids`` still
gives the generated ids through the log-probs; its prompt ids come from ``/tokenize``.
``sampling_overrides`` are applied last, whatever the harness sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from api import jsonbytes

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


def _logprob_ids(
    choice: Mapping[str, Any],
) -> tuple[list[int] | None, list[float] | None, str | None]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list):
        return None, None, "upstream returned no log-probs"
    ids: list[int] = []
    values: list[float] = []
    for position, item in enumerate(content):
        token = item.get("token") if isinstance(item, Mapping) else None
        if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
            return None, None, f"log-prob token {position} is {token!r}, not 'token_id:N'"
        try:
            ids.append(int(token[len(TOKEN_ID_PREFIX) :]))
            values.append(float(item["logprob"]))
        except (KeyError, TypeError, ValueError):
            return None, None, f"log-prob entry {position} is malformed: {item!r}"
    return ids, values, None


def read_generation(
    response: Mapping[str, Any], overridden_keys: tuple[str, ...] = ()
) -> Generation:
    """Reduce a chat-completions response; ``ids_problem`` says why ids are unusable."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamError(502, "upstream answered without a choice")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, Mapping):
        raise UpstreamError(502, "upstream choice has no message")
    ids, log_probs, problem = _logprob_ids(choice)
    token_ids = choice.get("token_ids")
    if problem is None and token_ids is not None and token_ids != ids:
        problem = (
            f"token_ids ({len(token_ids)} ids) and the log-prob tokens ({len(ids or [])} ids) "
            "disagree"
        )
    prompt_ids = response.get("prompt_token_ids")
    # The element types are checked once, when the entry is validated.
    if prompt_ids is not None and not isinstance(prompt_ids, list):
        problem = problem or "prompt_token_ids is not a list"
    usage = response.get("usage")
    return Generation(
        response=dict(response),
        message=dict(message),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=prompt_ids if problem is None else None,
        generation_token_ids=ids if problem is None else None,
        generation_log_probs=log_probs if problem is None else None,
        ids_problem=problem,
        overridden_keys=overridden_keys,
        usage=dict(usage) if isinstance(usage, Mapping) else {},
    )


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
    """One connection pool to the engine per worker."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.sampling_overrides = dict(sampling_overrides or {})
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
            ),
        )
        self._urls: dict[str, httpx.URL] = {}

    def _url(self, path: str) -> httpx.URL:
        # httpx parses a relative URL again on every request; each path is merged once.
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self._http.build_request("POST", path).url
        return url

    async def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        content = jsonbytes.dumps(body)  # ValueError for NaN, as httpx's json= raised
        try:
            response = await self._http.post(self._url(path), content=content, headers=JSON_HEADERS)
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
        """The configured model, else the upstream's first, else what the harness named."""
        if self.model is None:
            try:
                models = await self.models()
            except UpstreamError:
                models = []
            if models:
                self.model = str(models[0]["id"])
        if self.model is not None:
            return self.model
        return requested if isinstance(requested, str) else ""

    async def chat(self, chat_request: Mapping[str, Any]) -> Generation:
        """One upstream call; prompt ids from ``/tokenize`` if the response lacks them."""
        model = await self.model_name(chat_request.get("model"))
        body, overridden = upstream_request(chat_request, model, self.sampling_overrides)
        generation = read_generation(await self._post("/v1/chat/completions", body), overridden)
        if generation.ids_problem is None and generation.prompt_token_ids is None:
            try:
                prompt_ids = await self.tokenize(body)
            except UpstreamError as exc:
                return _with(generation, ids_problem=f"no prompt ids: {exc.message}")
            return _with(generation, prompt_token_ids=prompt_ids)
        return generation

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
    if "ids_problem" in changes:
        changes.update(prompt_token_ids=None, generation_token_ids=None, generation_log_probs=None)
    return replace(generation, **changes)
