"""The model-server front end: a FastAPI app harnesses call instead of the engine.

A model call travels one way: the prefix router (``api.routing``) strips the rollout prefix
and opens the capture context; the dialect translates the request into one chat request;
the upstream client calls the engine; the capture step stores the ids; the dialect builds
the reply, streamed or not. Each step reads only the previous step's output.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api import jsonbytes, sse
from api.capture_step import capture
from api.dialects import anthropic, chat, responses
from api.dialects.common import RequestError
from api.jsonbytes import JSONBytesResponse
from api.metrics import FrontEndMetrics
from api.routing import ASGIApp, CapturePrefixRouter, Receive, Scope, Send
from api.settings import ServerSettings, settings_from_environment
from api.upstream import UpstreamClient, UpstreamError
from capture.context import begin_call, current_call, void_call
from capture.registry import install_token_sink, installed_token_sink

BODY_METHODS = ("POST", "PUT", "PATCH")


@dataclass(frozen=True)
class Dialect:
    """The four functions that make one wire dialect."""

    name: str
    to_chat: Callable[[Mapping[str, Any]], dict[str, Any]]
    reply: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    stream: Callable[[dict[str, Any], Mapping[str, Any]], Iterator[bytes]]
    error_body: Callable[[int, str], dict[str, Any]]


DIALECTS = {
    "anthropic": Dialect(
        "anthropic",
        anthropic.to_chat,
        anthropic.reply,
        lambda reply, body: sse.anthropic_events(reply),
        anthropic.error_body,
    ),
    "chat": Dialect(
        "chat",
        chat.to_chat,
        chat.reply,
        lambda reply, body: sse.chat_chunks(reply, chat.include_usage(body)),
        chat.error_body,
    ),
    "responses": Dialect(
        "responses",
        responses.to_chat,
        responses.reply,
        lambda reply, body: sse.responses_events(reply),
        responses.error_body,
    ),
}


async def _chunks(events: Iterator[bytes]) -> AsyncIterator[bytes]:
    # The events are ready-made: iterating them on the loop avoids a threadpool hop each.
    for chunk in events:
        yield chunk


def _plain_error(status: int, kind: str, message: str) -> bytes:
    # Readable by both SDKs: Anthropic reads error.type, OpenAI reads error.message.
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


class BodyLimit:
    """Answer 413 to a request body beyond ``max_bytes``; a body within it is replayed as is.

    Starlette's own limiter answers in plain text; harness SDKs read a JSON error body.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        while not too_large:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected: the app sees an empty body and the send goes nowhere
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            too_large = size > self.max_bytes
            if not message.get("more_body", False):
                break
        if too_large:
            body = _plain_error(
                413,
                "request_too_large",
                f"request body exceeds the limit of {self.max_bytes} bytes",
            )
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = jsonbytes.loads_stdlib(raw)
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _begin_call_while_dispatching() -> asyncio.Future[None] | None:
    """Write the call's intent while the engine works instead of before it.

    The intent does its job if it is durable before the call's reply can reach the harness:
    a freeze that lands before then sees the call pending, or makes ``begin_call`` fail,
    which marks the rollout incomplete, exactly as when the intent was written before
    dispatch. The caller awaits it before the capture step (so before the entry's put and
    before any reply), and before voiding a call that failed upstream. Overlapping it with
    the upstream call takes the intent's durable write (a thread hop and an fsync) off the
    call's latency. Untagged traffic has nothing to write: None.
    """
    if current_call() is None:
        return None
    return asyncio.ensure_future(begin_call())


async def serve_call(request: Request, dialect: Dialect) -> Response:
    """One model call: translate, call upstream, capture, reply."""
    state = request.app.state
    metrics: FrontEndMetrics = state.metrics
    try:
        body = await _json_body(request)
        chat_request = dialect.to_chat(body)
    except (RequestError, TypeError, ValueError, KeyError, AttributeError) as exc:
        metrics.record_call(dialect.name, "bad_request")
        return JSONResponse(dialect.error_body(400, str(exc)), status_code=400)
    intent = _begin_call_while_dispatching()
    started = time.perf_counter()
    try:
        generation = await state.upstream.chat(chat_request)
    except Exception as exc:
        if intent is not None:
            await intent
        # Nothing reached the harness: the intent is resolved, the rollout is not masked.
        await void_call()
        metrics.record_call(dialect.name, "upstream_error")
        status, message = (
            (exc.status, exc.message)
            if isinstance(exc, UpstreamError)
            else (502, f"upstream call failed: {type(exc).__name__}: {exc}")
        )
        return JSONResponse(dialect.error_body(status, message), status_code=status)
    finally:
        metrics.upstream_seconds.labels(dialect=dialect.name).observe(time.perf_counter() - started)
    if intent is not None:
        await intent  # durable before the entry, and so before any reply reaches the harness
    captured = await capture(generation)
    metrics.record_call(dialect.name, captured.outcome, captured.put_seconds)
    reply = dialect.reply(captured, body)
    if body.get("stream") is True:
        return StreamingResponse(
            _chunks(dialect.stream(reply, body)),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    return JSONBytesResponse(reply)


def _request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI for a body the endpoint reads itself (so unknown fields stay accepted)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """The front end; each worker builds its own sink and upstream client at startup."""
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The configured sink, else one the embedding process installed (install_token_sink).
        sink = settings.build_sink()
        owned = sink is not None
        if sink is None:
            sink = installed_token_sink()
        start = getattr(sink, "start", None)
        if callable(start):
            # A sink that proves itself (Redis durability) fails this worker now, not a call.
            started = start()
            if inspect.isawaitable(started):
                await started
        app.state.token_sink = sink
        app.state.upstream = UpstreamClient(
            settings.upstream,
            model=settings.model,
            sampling_overrides=settings.sampling_overrides,
            timeout_s=settings.upstream_timeout_s,
            vocab_size=settings.vocab_size,
        )
        previous = install_token_sink(sink) if owned else None
        try:
            yield
        finally:
            await app.state.upstream.close()
            if owned:
                install_token_sink(previous)
                await sink.close()

    app = FastAPI(title="tokcap front end", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = FrontEndMetrics()
    app.state.token_sink = None
    app.add_middleware(CapturePrefixRouter, sink_provider=lambda: app.state.token_sink)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/v1", methods=["GET", "HEAD"], include_in_schema=False)
    async def base_path() -> dict[str, str]:
        """A base URL answers (harnesses probe it with HEAD before the first call)."""
        return {"status": "ok", "service": "tokcap"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = app.state.metrics.exposition()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        """The served models, in a shape both SDKs read (OpenAI and Anthropic fields)."""
        try:
            upstream = await app.state.upstream.models()
        except UpstreamError as exc:
            if not settings.model:
                return JSONResponse(
                    chat.error_body(exc.status, exc.message), status_code=exc.status
                )
            upstream = [{"id": settings.model}]
        data = [
            {
                "id": str(item["id"]),
                "object": "model",
                "type": "model",
                "created": int(item.get("created") or 0),
                "created_at": "1970-01-01T00:00:00Z",
                "owned_by": str(item.get("owned_by") or "tokcap"),
                "display_name": str(item["id"]),
            }
            for item in upstream
        ]
        ids = [item["id"] for item in data]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": ids[0] if ids else None,
                "last_id": ids[-1] if ids else None,
            }
        )

    @app.post("/v1/messages", openapi_extra=_request_body(anthropic.REQUEST_SCHEMA))
    async def messages(request: Request) -> Response:
        return await serve_call(request, DIALECTS["anthropic"])

    @app.post("/v1/messages/count_tokens", openapi_extra=_request_body(anthropic.COUNT_SCHEMA))
    async def count_tokens(request: Request) -> Response:
        """Prompt length as the upstream renders it; not a model call, never captured."""
        try:
            chat_request = anthropic.count_request(await _json_body(request))
        except (RequestError, TypeError, ValueError, KeyError, AttributeError) as exc:
            return JSONResponse(anthropic.error_body(400, str(exc)), status_code=400)
        client: UpstreamClient = app.state.upstream
        chat_request["model"] = await client.model_name(chat_request.get("model"))
        try:
            ids = await client.tokenize(chat_request)
        except UpstreamError as exc:
            return JSONResponse(
                anthropic.error_body(exc.status, exc.message), status_code=exc.status
            )
        return JSONResponse({"input_tokens": len(ids)})

    @app.post("/v1/chat/completions", openapi_extra=_request_body(chat.REQUEST_SCHEMA))
    async def chat_completions(request: Request) -> Response:
        return await serve_call(request, DIALECTS["chat"])

    @app.post("/v1/responses", openapi_extra=_request_body(responses.REQUEST_SCHEMA))
    async def responses_create(request: Request) -> Response:
        return await serve_call(request, DIALECTS["responses"])

    return app


def create_app_from_env() -> FastAPI:
    """The factory uvicorn workers call (``api.app:create_app_from_env``, factory=True)."""
    return create_app(settings_from_environment())
