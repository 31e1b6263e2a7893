"""The tokcap engine's HTTP app: one engine's wire format plus the ground truth.

``settings.wire`` picks the routes, reply shapes and error bodies: vLLM 0.10.2's
(``tokcap_devtools.engine.wire_vllm``, the default) or SGLang 0.5.23's (``tokcap_devtools.engine.wire_sglang``). Both wires
share ``GET /health`` and, with ``settings.ground_truth`` (``--ground-truth``), ``GET``/``DELETE
/tokcap/ground_truth`` (every sampled sequence, for tests and the demo; nobody else should
read another's samples), ``GET /tokcap/aborted`` (``tokcap_devtools.engine.pacing``) and ``GET
/tokcap/pauses`` (``tokcap_devtools.engine.pause``), and sample the same sequences for the same
request. With an ``api_key`` each wire asks for it where its engine does
(``tokcap_devtools.engine.auth``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from . import wire_sglang, wire_vllm
from .auth import ApiKeyMiddleware
from .generation import Engine
from .settings import EngineSettings

WIRES = {"vllm": wire_vllm, "sglang": wire_sglang}


def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def health() -> Response:
    return Response(status_code=200)


async def ground_truth(request: Request) -> Response:
    return Response(_engine(request).ground_truth.json_text(), media_type="application/json")


async def clear_ground_truth(request: Request) -> Response:
    _engine(request).ground_truth.clear()
    return Response(status_code=204)


async def pace_counts(request: Request) -> dict[str, int]:
    """Paced requests in flight now, and the most at once since the engine started."""
    return _engine(request).pace.counts()


async def aborted(request: Request) -> list[dict]:
    """The requests whose client left while the paced engine was answering them."""
    return list(_engine(request).pace.aborted)


async def pauses(request: Request) -> dict:
    """Whether the engine is paused, the requests it holds, has in flight and has frozen, and
    every pause so far (its mode, when, the requests it found in flight, when it ended)."""
    return _engine(request).pauses.state()


SHARED_ROUTES = (("/health", health, "GET"),)
GROUND_TRUTH_ROUTES = (
    ("/tokcap/ground_truth", ground_truth, "GET"),
    ("/tokcap/ground_truth", clear_ground_truth, "DELETE"),
    ("/tokcap/aborted", aborted, "GET"),
    ("/tokcap/pace", pace_counts, "GET"),
    ("/tokcap/pauses", pauses, "GET"),
)


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or EngineSettings()
    wire = WIRES[settings.wire]
    app = FastAPI(title="tokcap engine", version="0.1.0")
    app.state.engine = Engine(settings)
    for exception, handler in wire.HANDLERS:
        app.add_exception_handler(exception, handler)
    routes = (*SHARED_ROUTES, *(GROUND_TRUTH_ROUTES if settings.ground_truth else ()))
    for path, endpoint, method in (*routes, *wire.ROUTES):
        app.add_api_route(path, endpoint, methods=[method])
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, guarded=wire.needs_key)
    return app
