"""Model calls served straight from the edge, past FastAPI's router.

Nearly every request a front end serves is a model call, and each one held a call's worth
of framework while it waited on the engine: FastAPI's exception and exit-stack layers, the
router's match over every route, and the route's request wrapper (eleven coroutines, three
exit stacks and their closures a call, all walked by the garbage collector while a thousand
calls wait). The model endpoints read their own body and use none of it (no dependencies,
no ``HTTPException``), so this innermost middleware hands a ``POST`` to a model path
directly to its endpoint. Everything else, and every other method on those paths, goes on
to the router, where the routes stay registered for the OpenAPI pages.

It runs inside the edge's other middleware (the key check, the body limits, the rollout
prefix), so a model call is checked, limited and captured exactly as before; an error
that escapes the endpoint still reaches starlette's outermost ``ServerErrorMiddleware``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response

from api.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class ModelCallDispatch:
    """Send a ``POST`` to a model path (``endpoints``: path -> endpoint) to its endpoint."""

    def __init__(self, app: ASGIApp, endpoints: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.endpoints = dict(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)
