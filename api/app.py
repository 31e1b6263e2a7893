"""The model-server front end: a FastAPI app harnesses call instead of the engine.

Wiring only. A model call travels one way through the rooms of ``api``: the edge
(``api.edge``: the key check, body limits, the rollout prefix that opens the capture
context), the call (``api.call``: the dialect translates, the engine room's client calls the
engine, the capture step stores the ids, the reply or its kept-alive stream goes back).
Each step reads only the previous step's output. This module builds the worker's parts
(``api.state.FrontEnd``), its middleware and its routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from api.call.collisions import CollisionWatch
from api.call.policy import PolicyVersion, policy_version_route
from api.call.routes import OwnBodyRoute, count_tokens, model_route, models
from api.call.serve import serve_call
from api.call.updates import WeightUpdates, pause_route, resume_route
from api.collector import collect_on_a_clock, stop_collecting_on_allocations
from api.dialects import DIALECTS, anthropic
from api.edge import status
from api.edge.body import BodyLimit
from api.edge.keys import OPEN_PATHS, RequireKey
from api.edge.metrics import FrontEndMetrics
from api.edge.model_calls import Endpoint, ModelCallDispatch
from api.edge.prefix import CapturePrefixRouter, SinkSlot
from api.engine.client import UpstreamClient
from api.engine.engines_file import apply_engines, named_engines, watch_engines
from api.engine.pool import EnginePool
from api.prompts.faithful import faithful_prompts
from api.settings import ServerSettings, settings_from_environment
from api.state import FrontEnd
from capture.protocols import StartupCheck, TokenSink
from capture.registry import installed_token_sink


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


# FastAPI's own OpenTelemetry (0.16x) is off: the front end's metrics are Prometheus'
# (``api.edge.metrics``), and FastAPI would ask the OpenTelemetry providers on every request.
# An older FastAPI keeps the setting as an unused extra.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}


@asynccontextmanager
async def _lifespan(app: FastAPI, front: FrontEnd, own_process: bool) -> AsyncIterator[None]:
    """This worker's sink (into the slot the router reads), engine pool, prompts and
    policy version; then closed. ``own_process``: the worker is a process of its own."""
    settings = front.settings
    sink, owned = await _start_sink(settings)
    front.slot.sink = sink
    clients = [UpstreamClient.from_settings(settings, e) for e in named_engines(settings)]
    engines = EnginePool(clients, front.metrics)
    prompts = faithful_prompts(settings)
    policy = PolicyVersion(sink)
    front.started(engines, prompts, policy)
    with contextlib.suppress(Exception):
        await policy.refresh()  # a version set before this worker started
    following = [
        asyncio.create_task(engines.learn()),
        asyncio.create_task(policy.follow()),
        asyncio.create_task(engines.watch_health()),
    ]
    if own_process:  # an embedded app leaves its process's collector as it is
        stop_collecting_on_allocations()
        following.append(asyncio.create_task(collect_on_a_clock()))
    if settings.engines_file:
        apply = functools.partial(apply_engines, engines, settings, prompts)
        following.append(asyncio.create_task(watch_engines(settings.engines_file, apply)))
    try:
        yield
    finally:
        for task in following:
            task.cancel()
        front.slot.sink = None
        await engines.close()
        if owned and sink is not None:
            await sink.close()


def _add_routes(app: FastAPI) -> None:
    """Model calls first: a request walks the routes in order, and nearly all are those
    (though ``ModelCallDispatch`` serves their POSTs before the router)."""
    for dialect in DIALECTS.values():
        app.router.add_api_route(
            dialect.PATH,
            model_route(dialect),
            methods=["POST"],
            openapi_extra=_request_body(dialect.REQUEST_SCHEMA),
            route_class_override=OwnBodyRoute,
        )
    app.router.add_api_route(
        "/v1/messages/count_tokens",
        count_tokens,
        methods=["POST"],
        openapi_extra=_request_body(anthropic.COUNT_SCHEMA),
        route_class_override=OwnBodyRoute,
    )
    for path in ("/", "/v1"):
        app.add_api_route(path, status.base_path, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/health", status.health, methods=["GET"])
    app.add_api_route("/ready", status.ready, methods=["GET"])
    app.add_api_route("/metrics", status.metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route(
        "/tokcap/policy_version",
        policy_version_route,
        methods=["GET", "PUT"],
        include_in_schema=False,
    )
    app.add_api_route("/tokcap/pause", pause_route, methods=["POST"], include_in_schema=False)
    app.add_api_route("/tokcap/resume", resume_route, methods=["POST"], include_in_schema=False)


def create_app(settings: ServerSettings | None = None, *, own_process: bool = False) -> FastAPI:
    """The front end; each worker builds its own sink and upstream client at startup.
    ``own_process``: the app is all its process serves (``tokcap serve``'s workers)."""
    settings = settings or ServerSettings()
    metrics = FrontEndMetrics()
    collisions = CollisionWatch(metrics.rollout_id_collisions)
    updates = WeightUpdates(metrics.held_seconds, settings.upstream_timeout_s, metrics.resent)
    front = FrontEnd(settings, metrics, SinkSlot(), collisions, updates)
    # The OpenAPI pages describe every route to whoever asks: served only when turned on.
    pages = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="tokcap front end",
        version="0.1.0",
        lifespan=functools.partial(_lifespan, front=front, own_process=own_process),
        telemetry=NO_TELEMETRY,
        **pages,
    )
    app.state.front_end = front
    # The model calls' POSTs go straight to ``serve_call``, past the router and the routes.
    endpoints: dict[str, Endpoint] = {
        dialect.PATH: functools.partial(serve_call, dialect=dialect)
        for dialect in DIALECTS.values()
    }
    app.add_middleware(ModelCallDispatch, endpoints=endpoints)  # innermost
    app.add_middleware(
        CapturePrefixRouter, slot=front.slot, capture_timeout_s=settings.capture_timeout_s
    )
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        max_inflight_bytes=settings.max_inflight_bytes,
        body_timeout_s=settings.body_timeout_s,
        body_wait_s=settings.body_wait_s,
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
    return create_app(settings_from_environment(), own_process=True)
