"""The client of the upstream engine: one connection pool, one adapter, checked replies.

A model call becomes one request in the engine's own format (``api.engine.adapter``; the
family is ``model_server.engine`` or, with ``auto``, learned from the engine's answers as
the worker starts, or at the first call): whole, or relayed as a stream where the engine's
stream carries every id. Its reply is read and checked by the adapter before anything is
captured. Around the adapter the client handles what every engine shares:

- the base URL may end in ``/v1`` or not; ``upstream_api_key`` goes out as
  ``Authorization: Bearer`` and never into a message or a log line; a user and password in
  the URL go out as basic auth, and messages show the upstream as host:port only;
- ``max_tokens`` is lowered to the room the context window leaves (``api.engine.clamp``);
- an empty tool list is not sent (vLLM answers ``tools: []`` with ``tool_choice`` with a 400).
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from api import jsonbytes
from api.engine import FAMILIES, detect, engine_family
from api.engine.adapter import STREAM_PARAMS, EngineAdapter, IdsStream
from api.engine.clamp import Clamp, after_refusal, clamped
from api.engine.generation import Generation, UpstreamError, with_changes
from api.engine.http import ROUTING_KEY, TRANSPORT_ERRORS, EngineHTTP, sse_chunk, sse_data
from api.engine.reply_ids import SpanMemo, loads_with_ids
from api.engine.routes import with_routes
from api.types import Delta


def where(url: str) -> str:
    """A URL as scheme://host:port only: what messages may show of an upstream."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}"


def without_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its user and password, and those as a basic ``Authorization`` header
    value (None without).

    Credentials ride in the header, never in the URL the client is built on, so no
    message, log line or exception naming the URL can show them.
    """
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    return urlunsplit(bare), "Basic " + base64.b64encode(pair.encode()).decode()


def _error_message(status: int, content: bytes) -> str:
    try:
        body = jsonbytes.loads(content)
    except ValueError:
        text = content.decode("utf-8", "replace")[:500]
        return text or f"status {status}"
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


def _model_cards(body: Any) -> list[dict[str, Any]]:
    """The model cards of a ``GET /v1/models`` body (those with an id)."""
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list):
        return []
    return [item for item in data if isinstance(item, Mapping) and item.get("id")]


def _refusal(status: int, content: bytes) -> UpstreamError:
    """An engine's error reply as the harness is told it: the harness may fix a 4xx itself;
    a 5xx is the upstream's fault, a bad gateway."""
    return UpstreamError(
        status if status < 500 else 502,
        f"upstream: {_error_message(status, content)}",
        engine_down=status >= 500,
    )


class UpstreamClient:
    """One connection pool to the engine per worker, and what it learned of the engine.

    The engine family (``auto``) and ``max_model_len`` come from ``GET /v1/models`` as the
    worker starts (``EnginePool.learn``; else at the first call), and then whatever the
    family's adapter asks (``EngineAdapter.learn``). All are asked once and kept for the
    client's life.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        timeout_s: float = 600.0,
        vocab_size: int | None = None,
        engine: str = "auto",
        api_key: str | None = None,
        connections: int = 0,
        routed_experts: bool = False,
        moe: Any = None,
    ) -> None:
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer or None, not {vocab_size}")
        bare_url, basic_auth = without_credentials(base_url)
        self.base_url = re.sub(r"/v1/?$", "", bare_url.rstrip("/"))
        self.where = where(self.base_url)
        self.model = model
        self.sampling_overrides = dict(sampling_overrides or {})
        self.vocab_size = vocab_size
        self.engine = engine_family(engine)  # "auto" until the engine names its family
        self.adapter: EngineAdapter = FAMILIES.get(self.engine, FAMILIES["vllm"])()
        self.routed_experts = routed_experts  # every call's routes captured and checked
        self.moe = moe  # the MoE shape the routes are checked against (SGLang: shaped by)
        # A key wins over the URL's user and password.
        authorization = f"Bearer {api_key}" if api_key else basic_auth
        headers = {"authorization": authorization} if authorization else {}
        self._http = EngineHTTP(
            self.base_url, headers=headers, timeout_s=timeout_s, connections=connections
        )
        self._served_model: str | None = None  # the upstream's first model, once asked
        self.max_model_len: int | None = None
        self._learn_lock = asyncio.Lock()
        self._learned = False
        # Each rollout's last prompt ids as the engine sent them (``reply_ids.SpanMemo``).
        self._spans = SpanMemo()

    @classmethod
    def from_settings(cls, settings: Any, engine: Any = None) -> UpstreamClient:
        """The client of one engine (``EngineSettings``; the first named when None) that a
        front end's ``ServerSettings`` describe."""
        engine = engine or settings.engines[0]
        return cls(
            engine.url,
            model=settings.model,
            sampling_overrides=settings.sampling_overrides,
            timeout_s=settings.upstream_timeout_s,
            vocab_size=settings.vocab_size,
            engine=settings.engine,
            api_key=engine.api_key or settings.upstream_api_key,
            connections=settings.upstream_connections,
            routed_experts=settings.routed_experts,
            moe=settings.moe,
        )

    async def _taken(self, path: str, content: bytes) -> bytes:
        """The reply body of one POST the engine took; an ``UpstreamError`` otherwise."""
        try:
            status, reply = await self._http.post(path, content)
        except TRANSPORT_ERRORS as exc:
            raise self._unreachable(exc) from exc
        if status >= 400:
            raise _refusal(status, reply)
        return reply

    async def post(
        self, path: str, body: Mapping[str, Any], ids_key: str | None = None
    ) -> dict[str, Any]:
        """One POST of a JSON body; its JSON object reply, or an ``UpstreamError``.
        ``ids_key``: the reply's top-level id list, read off the bytes (``reply_ids``)."""
        reply = await self._taken(path, jsonbytes.dumps(body))  # ValueError for NaN
        try:
            data = (
                loads_with_ids(reply, ids_key, self._spans, ROUTING_KEY.get())
                if ids_key
                else jsonbytes.loads(reply)
            )
        except ValueError as exc:
            raise UpstreamError(502, "upstream answered with invalid JSON") from exc
        if not isinstance(data, dict):
            raise UpstreamError(502, "upstream answered with a non-object JSON body")
        return data

    async def command(self, path: str, body: Mapping[str, Any] | None) -> None:
        """A POST to one of the engine's control routes (pause, resume), whose answer is its
        status only; an ``UpstreamError`` unless the engine took it."""
        await self._taken(path, jsonbytes.dumps(body) if body is not None else b"")

    async def pause(self, mode: str) -> None:
        """Pause the engine for a weight update (``EngineAdapter.pause``)."""
        await self.learn()
        await self.adapter.pause(self.command, mode)

    async def resume(self) -> None:
        await self.learn()
        await self.adapter.resume(self.command)

    async def ask(self, path: str) -> tuple[int, Any]:
        """(status, body) of a GET; (0, None) when the engine could not be reached."""
        try:
            status, reply = await self._http.get(path)
        except TRANSPORT_ERRORS:
            return 0, None
        try:
            return status, jsonbytes.loads(reply)
        except ValueError:
            return status, None

    async def models(self) -> list[dict[str, Any]]:
        status, body = await self.ask("/v1/models")
        if status != 200 or not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
            reason = f"status {status}" if status else "unreachable"
            raise UpstreamError(502, f"upstream models unavailable ({self.where}: {reason})")
        return _model_cards(body)

    async def learn(self) -> None:
        """Ask the engine once what it is: its family, max_model_len, and its adapter's
        questions."""
        if self._learned:
            return
        async with self._learn_lock:
            if self._learned:
                return
            status, body = await self.ask("/v1/models")
            models = _model_cards(body) if status == 200 else []
            if models:
                self._served_model = str(models[0]["id"])
                length = models[0].get("max_model_len")
                self.max_model_len = length if isinstance(length, int) and length > 0 else None
            if self.engine == "auto" and status:  # only an engine that answered names itself
                self.engine = await detect(models, self.ask)
                self.adapter = FAMILIES[self.engine]()
            if status:
                await self.adapter.learn(self.ask, self.where)
            # Any answer settles it; an engine not up yet is asked again at the next call.
            self._learned = status != 0

    async def can_relay(self, token_in: bool = False) -> bool:
        """Whether a streamed call can be relayed as the engine samples it: an engine whose
        chat stream (``token_in``: token-in stream) carries every chunk's ids
        (``EngineAdapter.relays``, ``relays_ids``), unless routes are captured (no stream
        carries them)."""
        await self.learn()
        if self.routed_experts:
            return False
        return self.adapter.relays_ids() if token_in else self.adapter.relays()

    def _routed(
        self, generation: Generation, response: Mapping[str, Any], start: int = 0
    ) -> Generation:
        """The generation with its checked routes, where routes are captured."""
        if not self.routed_experts:
            return generation
        return with_routes(generation, response, self.adapter, self.moe, start)

    def routes_start_allowed(self) -> bool:
        """Whether a token-in call may ask for the routes after a prompt position only."""
        return self.routed_experts and self.adapter.routes_start_field is not None

    def _unreachable(self, exc: BaseException) -> UpstreamError:
        return UpstreamError(
            502, f"upstream {self.where} unreachable: {type(exc).__name__}", engine_down=True
        )

    async def _chat_body(
        self, chat_request: Mapping[str, Any]
    ) -> tuple[dict[str, Any], tuple[str, ...], Clamp | None]:
        """The engine's chat body for a request, the sampling keys overridden, and the clamp
        of ``max_tokens`` to the context window (an empty tool list is not sent: vLLM
        answers ``tools: []`` with ``tool_choice`` with a 400)."""
        model = await self.model_name(chat_request.get("model"))
        body, overridden = self.adapter.chat_body(chat_request, model, self.sampling_overrides)
        if self.routed_experts:
            body.update(self.adapter.routes_request)
        if not body.get("tools"):
            body.pop("tools", None)
            body.pop("tool_choice", None)
        return body, overridden, clamped(body, self.max_model_len)

    async def chat_relay(
        self, chat_request: Mapping[str, Any]
    ) -> AsyncIterator[Delta | Generation]:
        """One streamed upstream call: what each chunk adds, as it arrives, then the whole
        generation, checked as a non-streamed reply is."""
        body, overridden, clamp = await self._chat_body(chat_request)
        adapter = self.adapter  # known once the engine was asked (``_chat_body``)
        body.update(STREAM_PARAMS)
        stream = adapter.chat_stream()
        async with self._opened_stream(adapter.chat_path, body, clamp) as (reply, clamp):
            async for data in self._events(reply):
                delta = stream.add(sse_chunk(data))
                if delta:
                    yield delta
        generation = adapter.read_chat(stream.response(), overridden, self.vocab_size)
        problem = stream.unfinished()
        if problem is not None:
            generation = with_changes(generation, ids_problem=problem)
        yield with_changes(generation, max_tokens_clamp=clamp) if clamp else generation

    @asynccontextmanager
    async def _opened_stream(
        self, path: str, body: dict[str, Any], clamp: Clamp | None
    ) -> AsyncIterator[tuple[Any, Clamp | None]]:
        """The engine's streamed reply, once it answered 200 (a context-length refusal is
        retried once with the room it names, as for a whole call); (reply, the clamp)."""
        for attempt in range(2):
            try:
                async with self._http.stream(path, jsonbytes.dumps(body)) as reply:
                    if reply.status < 400:
                        yield reply, clamp
                        return
                    content = await reply.read()
            except TRANSPORT_ERRORS as exc:
                raise self._unreachable(exc) from exc
            error = _refusal(reply.status, content)
            if attempt:
                raise error
            clamp = after_refusal(error, body, self.max_model_len, clamp)

    @property
    def served_model(self) -> str | None:
        """The engine's first served model, once asked (``learn``)."""
        return self._served_model

    async def model_name(self, requested: Any) -> str:
        """The configured model, else the upstream's first, else what the harness named."""
        await self.learn()
        if self.model is not None:
            return self.model
        if self._served_model is not None:
            return self._served_model
        return requested if isinstance(requested, str) else ""

    async def chat(self, chat_request: Mapping[str, Any]) -> Generation:
        """One whole upstream call, read and checked by the adapter."""
        body, overridden, clamp = await self._chat_body(chat_request)
        adapter = self.adapter  # known once the engine was asked (``_chat_body``)
        try:
            response = await self.post(adapter.chat_path, body, adapter.prompt_ids_key)
        except UpstreamError as exc:
            clamp = after_refusal(exc, body, self.max_model_len, clamp)
            response = await self.post(adapter.chat_path, body, adapter.prompt_ids_key)
        generation = adapter.read_chat(response, overridden, self.vocab_size)
        if clamp is not None:
            generation = with_changes(generation, max_tokens_clamp=clamp)
        generation = await adapter.completed(generation, body, self.post, self.vocab_size)
        return self._routed(generation, response)

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: Mapping[str, Any],
        model: Any = None,
        routes_start: int = 0,
    ) -> Generation:
        """A token-in call: the engine continues exactly ``prompt_ids``; the reply is checked.

        ``routes_start``: where routes are captured, the engine is asked for the rows from
        that prompt position on (``routes_start_allowed``; a stored prefix covers the rest).
        """
        path, body, clamp = await self._tokens_request(prompt_ids, sampling, model)
        start = routes_start if self.routes_start_allowed() else 0  # the engine is known now
        if start:
            body[self.adapter.routes_start_field] = start
        response = await self.post(path, body)
        return self._tokens_generation(response, prompt_ids, clamp, start)

    async def complete_ids_relay(
        self, prompt_ids: list[int], sampling: Mapping[str, Any], model: Any = None
    ) -> AsyncIterator[IdsStream | Generation]:
        """A streamed token-in call: its stream after each event (``IdsStream.sampled``
        reads the ids so far), then the whole generation, checked as a whole reply is."""
        path, body, clamp = await self._tokens_request(prompt_ids, sampling, model)
        stream = self.adapter.tokens_stream(body)
        async with self._opened_stream(path, body, clamp) as (reply, clamp):
            async for data in self._events(reply):
                stream.add(data)
                yield stream
        generation = self._tokens_generation(stream.response(), prompt_ids, clamp)
        problem = stream.unfinished()
        yield generation if problem is None else with_changes(generation, ids_problem=problem)

    async def _events(self, reply: Any) -> AsyncIterator[str]:
        """The data of each event of an engine's stream, until ``[DONE]``."""
        try:
            async for line in reply.content:
                data = sse_data(line)
                if data == "[DONE]":
                    return
                if data is not None:
                    yield data
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError(
                502,
                f"upstream {self.where} stream broke off: {type(exc).__name__}",
                engine_down=True,
            ) from exc

    async def _tokens_request(
        self, prompt_ids: list[int], sampling: Mapping[str, Any], model: Any
    ) -> tuple[str, dict[str, Any], Clamp | None]:
        """A token-in call's path, body and clamp.

        ``max_tokens`` is lowered at once to the room ``max_model_len`` leaves (the prompt's
        length is known here, so no refusal has to name it), and is that room when the
        request names none, as a chat call's would be.
        """
        name = await self.model_name(model)
        params = {**sampling, **self.sampling_overrides}
        if params.get("max_tokens") is None and self.max_model_len is not None:
            # A chat call without max_tokens may fill the context; a token-in call would
            # stop at the route's own default (vLLM completions: 16, SGLang /generate: 128).
            params["max_tokens"] = max(self.max_model_len - len(prompt_ids), 1)
        clamp = clamped(params, self.max_model_len, len(prompt_ids))
        path, body = self.adapter.tokens_body(prompt_ids, name, params)
        if self.routed_experts:
            body.update(self.adapter.routes_request)
        return path, body, clamp

    def _tokens_generation(
        self,
        response: Mapping[str, Any],
        prompt_ids: list[int],
        clamp: Clamp | None,
        routes_start: int = 0,
    ) -> Generation:
        generation = self.adapter.read_tokens(response, prompt_ids, self.vocab_size)
        generation = self._routed(generation, response, routes_start)
        return with_changes(
            generation,
            overridden_keys=tuple(sorted(self.sampling_overrides)),
            max_tokens_clamp=clamp,
        )

    async def tokenize(self, chat_request: Mapping[str, Any]) -> list[int]:
        """The prompt ids of a chat request, rendered by the upstream."""
        model = await self.model_name(None)
        return await self.adapter.tokenize(chat_request, model, self.post)

    async def close(self) -> None:
        await self._http.close()
