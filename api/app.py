"""The model-server front end: a FastAPI app harnesses call instead of the engine.

A model call travels one way: the prefix router (``api.edge.prefix``) strips the rollout prefix
and opens the capture context; the dialect translates the request into one chat request;
the upstream client calls the engine; the capture step stores the ids; the dialect builds
the reply, streamed or not (``api.call.serve``: the wait, keep-alive and hang-ups). Each step
reads only the previous step's output. This module wires the routes, the probes and the
worker's start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from api.call.collisions import CollisionWatch
from api.call.policy import PolicyVersion, policy_version_route
from api.call.serve import Dialect, serve_call
from api.dialects import anthropic, chat, responses
from api.dialects.common import RequestError
from api.edge.body import BodyLimit, parse_json_object
from api.edge.metrics import FrontEndMetrics
from api.edge.prefix import OPEN_PATHS, CapturePrefixRouter, RequireKey, SinkSlot
from api.engine.client import UpstreamClient
from api.engine.generation import UpstreamError
from api.prompts.faithful import FaithfulPrompts, faithful_prompts
from api.settings import ServerSettings, settings_from_environment
from capture.protocols import StartupCheck, TokenSink
from capture.registry import installed_token_sink

# How long /ready waits for the sink and for the upstream; a probe must answer quickly.
READY_TIMEOUT_S = 2.0
# How long a /metrics scrape waits for the Redis memory reading before it answers without.
SCRAPE_MEMORY_TIMEOUT_S = 0.5


DIALECTS = {module.NAME: Dialect.of(module) for module in (anthropic, chat, responses)}


async def _json_body(request: Request) -> dict[str, Any]:
    return parse_json_object(await request.body())


def _request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI for a body the endpoint reads itself (so unknown fields stay accepted)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _start_sink(settings: ServerSettings) -> tuple[TokenSink | None, bool]:
    """This worker's sink and whether it owns it (so closes it at shutdown).

    The configured sink is built here, once per worker; without one, a sink the embedding
    process installed (``install_token_sink``) is used. A sink that proves itself
    (``StartupCheck``: Redis durability) fails the worker now, not a harness's call.
    """
    sink = settings.build_sink()
    owned = sink is not None
    if sink is None:
        sink = installed_token_sink()
    if isinstance(sink, StartupCheck):
        await sink.start()
    return sink, owned


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: ServerSettings, slot: SinkSlot) -> AsyncIterator[None]:
    """This worker's sink (into the slot the router reads) and upstream client, then closed."""
    sink, owned = await _start_sink(settings)
    slot.sink = sink
    app.state.upstream = UpstreamClient.from_settings(settings)
    app.state.prompts = faithful_prompts(settings)
    app.state.policy = PolicyVersion(sink)
    with contextlib.suppress(Exception):
        await app.state.policy.refresh()  # a version set before this worker started
    following = asyncio.create_task(app.state.policy.follow())
    try:
        yield
    finally:
        following.cancel()
        slot.sink = None
        await app.state.upstream.close()
        if owned and sink is not None:
            await sink.close()


async def base_path() -> dict[str, str]:
    """A base URL answers (harnesses probe it with HEAD before the first call)."""
    return {"status": "ok", "service": "tokcap"}


async def health() -> dict[str, str]:
    """Liveness: the process answers. Whether it can serve a call is ``/ready``'s question."""
    return {"status": "ok"}


async def _sink_problem(sink: TokenSink | None) -> str | None:
    """Why the sink cannot take an entry now, or None (also when there is no sink).

    Redis: a PING on the store's own client (its pool, its password); the file store: its
    directory is writable. The message names the server as host:port, never credentials.
    """
    if sink is None:
        return None
    ping = getattr(sink, "ping", None)
    if callable(ping):
        where = getattr(sink, "where", "redis")
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await ping()
        except Exception as exc:  # any failure means not ready; the type says which
            return f"{where} did not answer PING: {type(exc).__name__}"
        return None
    directory = getattr(sink, "dir", None)
    if directory is not None and not os.access(directory, os.W_OK | os.X_OK):
        return f"the capture directory {directory} is not writable"
    return None


async def _sink_memory(
    sink: TokenSink | None, metrics: FrontEndMetrics, timeout_s: float = READY_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Memory used against ``maxmemory`` on each server of a Redis sink (none for others),
    also set on the metrics' gauges; a server that does not answer is ``/ready``'s PING
    problem, so it is left out here."""
    memory = getattr(sink, "memory", None)
    if not callable(memory):
        return []
    try:
        async with asyncio.timeout(timeout_s):
            readouts = await memory()
    except Exception:  # not ready is said by the PING; the headroom is only informative
        return []
    metrics.record_memory(readouts)
    return [readout.as_dict() for readout in readouts]


async def _upstream_problem(upstream: UpstreamClient) -> str | None:
    """Why the upstream cannot serve a call now (GET /v1/models), or None."""
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await upstream.models()
    except TimeoutError:
        return f"upstream {upstream.where} did not answer within {READY_TIMEOUT_S} s"
    except UpstreamError:
        return f"upstream {upstream.where} did not list its models"
    return None


async def ready(request: Request) -> Response:
    """Readiness: 200 when the sink and the upstream answer, else 503 naming what does not.

    All are asked at once, each within READY_TIMEOUT_S, so a load balancer's probe gets its
    answer in about that time even when both are down. A Redis sink's memory headroom rides
    along (``redis_memory``): a server at its ``maxmemory`` refuses the next writes.
    """
    state = request.app.state
    sink = state.sink_slot.sink
    sink_problem, upstream_problem, memory = await asyncio.gather(
        _sink_problem(sink), _upstream_problem(state.upstream), _sink_memory(sink, state.metrics)
    )
    problems = {
        name: problem
        for name, problem in (("sink", sink_problem), ("upstream", upstream_problem))
        if problem is not None
    }
    extra = {"redis_memory": memory} if memory else {}
    if problems:
        return JSONResponse({"status": "not ready", "problems": problems, **extra}, status_code=503)
    return JSONResponse({"status": "ready", **extra})


async def metrics(request: Request) -> Response:
    state = request.app.state
    # The gauges, read now; a Redis that does not answer at once leaves the last reading.
    await _sink_memory(state.sink_slot.sink, state.metrics, SCRAPE_MEMORY_TIMEOUT_S)
    data, content_type = state.metrics.exposition()
    return Response(data, media_type=content_type)


def _model_card(item: Mapping[str, Any]) -> dict[str, Any]:
    """One served model, with the fields both SDKs read (OpenAI and Anthropic)."""
    return {
        "id": str(item["id"]),
        "object": "model",
        "type": "model",
        "created": int(item.get("created") or 0),
        "created_at": "1970-01-01T00:00:00Z",
        "owned_by": str(item.get("owned_by") or "tokcap"),
        "display_name": str(item["id"]),
    }


async def models(request: Request) -> Response:
    """The served models: the upstream's, else the configured model."""
    configured = request.app.state.settings.model
    try:
        upstream = await request.app.state.upstream.models()
    except UpstreamError as exc:
        if not configured:
            return JSONResponse(chat.error_body(exc.status, exc.message), status_code=exc.status)
        upstream = [{"id": configured}]
    data = [_model_card(item) for item in upstream]
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


async def count_tokens(request: Request) -> Response:
    """Prompt length as the prompt would be rendered; not a model call, never captured."""
    try:
        chat_request = anthropic.count_request(await _json_body(request))
    except (RequestError, TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        return JSONResponse(anthropic.error_body(400, str(exc)), status_code=400)
    prompts: FaithfulPrompts | None = request.app.state.prompts
    if prompts is not None:  # the front end renders every prompt: count what it would send
        try:
            ids = prompts.render(chat_request["messages"], chat_request.get("tools"))
        except RequestError as exc:
            return JSONResponse(anthropic.error_body(400, str(exc)), status_code=400)
        return JSONResponse({"input_tokens": len(ids)})
    client: UpstreamClient = request.app.state.upstream
    chat_request["model"] = await client.model_name(chat_request.get("model"))
    try:
        ids = await client.tokenize(chat_request)
    except UpstreamError as exc:
        return JSONResponse(anthropic.error_body(exc.status, exc.message), status_code=exc.status)
    return JSONResponse({"input_tokens": len(ids)})


def _model_route(dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await serve_call(request, dialect)

    endpoint.__name__ = f"{dialect.name}_call"
    return endpoint


# Model routes: path, dialect, the request schema documented in OpenAPI.
MODEL_ROUTES = (
    ("/v1/messages", "anthropic", anthropic.REQUEST_SCHEMA),
    ("/v1/chat/completions", "chat", chat.REQUEST_SCHEMA),
    ("/v1/responses", "responses", responses.REQUEST_SCHEMA),
)


def _add_routes(app: FastAPI) -> None:
    for path in ("/", "/v1"):
        app.add_api_route(path, base_path, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route(
        "/tokcap/policy_version",
        policy_version_route,
        methods=["GET", "PUT"],
        include_in_schema=False,
    )
    for path, name, schema in MODEL_ROUTES:
        route = _model_route(DIALECTS[name])
        app.add_api_route(path, route, methods=["POST"], openapi_extra=_request_body(schema))
    app.add_api_route(
        "/v1/messages/count_tokens",
        count_tokens,
        methods=["POST"],
        openapi_extra=_request_body(anthropic.COUNT_SCHEMA),
    )


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """The front end; each worker builds its own sink and upstream client at startup."""
    settings = settings or ServerSettings()
    slot = SinkSlot()
    # The OpenAPI pages describe every route to whoever asks: served only when turned on.
    pages = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="tokcap front end",
        version="0.1.0",
        lifespan=functools.partial(_lifespan, settings=settings, slot=slot),
        **pages,
    )
    app.state.settings = settings
    app.state.sink_slot = slot
    app.state.metrics = FrontEndMetrics()
    app.state.collisions = CollisionWatch(app.state.metrics.rollout_id_collisions)
    app.add_middleware(CapturePrefixRouter, slot=slot, capture_timeout_s=settings.capture_timeout_s)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        max_inflight_bytes=settings.max_inflight_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    if settings.auth_secret:
        # Outermost: a call without a key is refused before its body is read or counted.
        # The OpenAPI pages, when served, are for a browser, which sends no key.
        served = (app.docs_url, app.swagger_ui_oauth2_redirect_url, app.redoc_url, app.openapi_url)
        open_paths = OPEN_PATHS | {page for page in served if page and settings.docs}
        app.add_middleware(RequireKey, secret=settings.auth_secret, open_paths=open_paths)
    _add_routes(app)
    return app


def create_app_from_env() -> FastAPI:
    """The factory uvicorn workers call (``api.app:create_app_from_env``, factory=True)."""
    return create_app(settings_from_environment())
