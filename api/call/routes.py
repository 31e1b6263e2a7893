"""The routes a harness calls: one per dialect, the served models, and token counting.

Each dialect's route (``Dialect.PATH``, from the one map ``api.dialects.DIALECTS``) serves a
model call (``api.call.serve``). ``/v1/models`` and ``count_tokens`` are not model calls:
never captured.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from api.call.serve import serve_call
from api.dialects import anthropic, chat
from api.dialects.common import RequestError
from api.dialects.dialect import Dialect
from api.edge.errors import BAD_REQUEST_ERRORS, bad_request, error_response
from api.edge.json_body import parse_json_object
from api.engine.generation import UpstreamError
from api.state import front_end


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
    front = front_end(request)
    configured = front.settings.model
    try:
        upstream = await front.engines.models()
    except UpstreamError as exc:
        if not configured:
            return error_response(chat, exc.status, exc.message)
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
    front = front_end(request)
    try:
        chat_request = anthropic.count_request(parse_json_object(await request.body()))
    except BAD_REQUEST_ERRORS as exc:
        return bad_request(anthropic, exc)
    if front.prompts is not None:  # the front end renders every prompt: count what it would send
        try:
            ids = front.prompts.render(chat_request["messages"], chat_request.get("tools"))
        except RequestError as exc:
            return bad_request(anthropic, exc)
        return JSONResponse({"input_tokens": len(ids)})
    client = front.engines.first
    chat_request["model"] = await client.model_name(chat_request.get("model"))
    try:
        ids = await client.tokenize(chat_request)
    except UpstreamError as exc:
        return error_response(anthropic, exc.status, exc.message)
    return JSONResponse({"input_tokens": len(ids)})


class OwnBodyRoute(APIRoute):
    """A route whose endpoint takes the request alone and reads its body itself (model calls,
    token counting). FastAPI's request handler (dependencies, body parsing, a response
    model) has nothing to do for it and cost about 20 µs a call doing it; the route stays
    an ``APIRoute``, so its OpenAPI entry does too."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        return self.endpoint


def model_route(dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of one dialect's model calls."""

    async def endpoint(request: Request) -> Response:
        return await serve_call(request, dialect)

    endpoint.__name__ = f"{dialect.NAME}_call"
    return endpoint
