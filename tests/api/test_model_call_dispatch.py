"""Model calls go from the edge straight to their endpoint; anything else to the router."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.app import create_app
from api.dialects import DIALECTS
from api.edge.model_calls import ModelCallDispatch
from api.settings import ServerSettings


class Router:
    """Stands where FastAPI's router would: notes what reached it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append((scope["method"], scope["path"]))
        await Response(status_code=404)(scope, receive, send)


async def endpoint(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"path": request.url.path, "body": body.decode()})


def client(dispatch: ModelCallDispatch) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=dispatch), base_url="http://t")


async def test_a_post_to_a_model_path_is_served_by_its_endpoint_without_the_router():
    router = Router()
    async with client(ModelCallDispatch(router, {"/v1/messages": endpoint})) as http:
        reply = await http.post("/v1/messages", content=b'{"a":1}')
    assert reply.status_code == 200
    assert reply.json() == {"path": "/v1/messages", "body": '{"a":1}'}
    assert router.seen == []


async def test_other_methods_and_paths_go_on_to_the_router():
    router = Router()
    async with client(ModelCallDispatch(router, {"/v1/messages": endpoint})) as http:
        assert (await http.get("/v1/messages")).status_code == 404
        assert (await http.post("/v1/messages/")).status_code == 404
        assert (await http.post("/v1/models")).status_code == 404
    assert router.seen == [
        ("GET", "/v1/messages"),
        ("POST", "/v1/messages/"),
        ("POST", "/v1/models"),
    ]


def test_the_app_dispatches_every_dialect_and_keeps_its_routes_for_the_openapi_pages():
    app = create_app(ServerSettings(upstream="http://127.0.0.1:9", docs=True))
    dispatch = next(m for m in app.user_middleware if m.cls is ModelCallDispatch)
    assert set(dispatch.kwargs["endpoints"]) == {d.PATH for d in DIALECTS.values()}
    assert app.user_middleware[-1].cls is ModelCallDispatch  # innermost: after the edge's own
    paths = app.openapi()["paths"]
    assert all("post" in paths[d.PATH] for d in DIALECTS.values())
