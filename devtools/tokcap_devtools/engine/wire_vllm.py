"""vLLM 0.10.2's OpenAI-compatible routes, as the engine speaks them by default.

An MoE engine (``--routed-experts``) honours vLLM 0.32's ``routed_experts_prompt_start``
on both generation routes (``routes_start``).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``, ``GET /version``. Errors use vLLM's body
``{"error": {"message", "type", "param", "code"}}``; an invalid body is a 400, as in vLLM,
not FastAPI's 422; a prompt that does not fit is refused in vLLM 0.10.2's words
(``serving_engine.py`` ``_validate_input``). Any ``model`` name is accepted (vLLM would
answer 404 for a name it does not serve); replies carry the served name.

Weight updates use vLLM 0.32's RL routes (``vllm/entrypoints/rl/online/api_router.py``,
served with ``VLLM_SERVER_DEV_MODE=1``): ``POST /update_weight_version``, ``GET
/weight_info``, ``POST /pause?mode=abort|wait|keep`` (``{"status": "paused"}``; another mode
is a 400 in vLLM's error body, as its query validation answers), ``POST /resume``
(``{"status": "resumed"}``), ``GET /is_paused`` (``{"is_paused": bool}``) and ``POST
/abort_requests`` (``{"request_ids": [...]}``, the reply ids; none: every request, held ones
too, as vLLM has already queued them; ``{"status": "aborted", "aborted": N}``). What a pause
does to requests is ``tokcap_devtools.engine.pause``'s.
"""

from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus
from typing import Literal

from fastapi import Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from api import JSONBytesResponse

from . import calls, responses
from .generation import ContextLengthError, Engine, ScriptedError
from .pacing import CLIENT_CLOSED_REQUEST, streamed, whole
from .pause import Batches, Flight
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

_STATUSES = {status.value for status in HTTPStatus}
# The reply shapes follow vLLM 0.10.2's; every stream chunk carries its ids (tool-call
# pieces held back included), as from vLLM 0.12 on, which /version names by default
# (``EngineSettings.vllm_version``).
# What /version says while token_id_fields is off: a vLLM from before return_token_ids, so a
# client reading the version (api.engine.client) takes the engine for the old one it emulates.
LEGACY_VLLM_VERSION = "0.10.1"


def error_response(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def context_message(exc: ContextLengthError) -> str:
    """vLLM 0.10.2's words for a request that does not fit (``serving_engine.py``)."""
    limit, prompt = exc.limit, exc.prompt_tokens
    if exc.requested is None:
        return (
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt} input tokens. Please reduce the length of the input messages."
        )
    wanted = exc.requested
    return (
        f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's "
        f"maximum context length is {limit} tokens and your request has {prompt} input "
        f"tokens ({wanted} > {limit} - {prompt})."
    )


def _options(
    engine: Engine,
    req: SamplingFields,
    response_id: str,
    prompt_ids: list[int],
    logprobs: bool,
    top_logprobs: int,
) -> responses.ReplyOptions:
    stream_options = req.stream_options
    return responses.ReplyOptions(
        response_id=response_id,
        created=int(time.time()),
        model=engine.settings.model,  # vLLM answers with the served name
        prompt_ids=prompt_ids,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        as_token_ids=bool(req.return_tokens_as_token_ids),
        return_token_ids=bool(req.return_token_ids) and engine.settings.token_id_fields,
        id_fields=engine.settings.token_id_fields,
        include_usage=bool(stream_options and stream_options.include_usage),
        continuous_usage=bool(stream_options and stream_options.continuous_usage_stats),
        moe=engine.settings.moe,
    )


def routes_start(engine: Engine, req: SamplingFields, batches: Batches) -> str | None:
    """Apply ``routed_experts_prompt_start`` as vLLM 0.32 does, or say why it is refused.

    vLLM 0.32 (``v1/engine/input_processor.py``) refuses a start outside 0 to the prompt's
    length, inclusive, with a 400; its routes then cover the positions from the start to
    the last one read (``distributed/aux_output_connector``: rows ``[start, tokens - 1)``).
    Each generation keeps its start for its reply and the ground truth (an MoE only)."""
    start = req.routed_experts_prompt_start
    for prompt_ids, gens in batches:
        if start > len(prompt_ids):
            return (
                "routed_experts_prompt_start must be between 0 and the prompt length "
                f"({len(prompt_ids)}), inclusive."
            )
        for gen in gens if engine.settings.moe is not None else ():
            gen.routes_start = start
    return None


def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(str(exc.errors()))


async def _too_long(_: Request, exc: ContextLengthError) -> JSONResponse:
    return error_response(context_message(exc))


async def _scripted(_: Request, exc: ScriptedError) -> JSONResponse:
    kind = HTTPStatus(exc.status).phrase.replace(" ", "") if exc.status in _STATUSES else "Error"
    return error_response(exc.message, exc.status, kind)


async def version(request: Request) -> dict:
    fields = _engine(request).settings.token_id_fields
    return {"version": _engine(request).settings.vllm_version if fields else LEGACY_VLLM_VERSION}


def _permission(created: int) -> dict:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def models(request: Request) -> dict:
    settings = _engine(request).settings
    created = int(time.time())
    card = {
        "id": settings.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": settings.model,
        "parent": None,
        "max_model_len": settings.max_model_len,
        "permission": [_permission(created)],
    }
    return {"object": "list", "data": [card]}


async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    arrived = time.monotonic()
    engine = _engine(request)
    top = req.top_logprobs or 0
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    call = calls.run_chat(engine, req, top)
    refused = routes_start(engine, req, call.batches)
    if refused is not None:
        return error_response(refused)
    opts = _options(engine, req, response_id, call.prompt_ids, bool(req.logprobs), top)
    flight = engine.pauses.enter(response_id, call.batches, arrived, stream=bool(req.stream))
    if req.stream:
        lines = responses.chat_stream(engine.tokenizer, call.generations, opts, flight)
        return streamed(engine.pace, flight, lines)
    settled = await whole(engine.pace, request, flight)
    if settled is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    [(_, gens)] = settled
    return JSONBytesResponse(responses.chat_completion(engine.tokenizer, gens, opts))


async def completions(req: CompletionRequest, request: Request) -> Response:
    arrived = time.monotonic()
    engine = _engine(request)
    prompts = req.prompts
    if not prompts:
        return error_response("prompt must not be empty")
    for prompt in prompts:
        refused = calls.out_of_vocabulary(engine, prompt) if isinstance(prompt, list) else None
        if refused is not None:
            return error_response(refused)
    top = req.logprobs or 0
    first = prompts[0]
    first_ids = first if isinstance(first, list) else engine.tokenizer.encode(first)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    opts = _options(engine, req, response_id, first_ids, req.logprobs is not None, top)
    sampling = calls.sampling(engine, req, req.max_tokens, max(1, top))
    n = req.n or 1
    batches = []
    for prompt in prompts:
        prompt_ids, conversation = calls.token_prompt(engine, prompt)
        batches.append((prompt_ids, engine.generate(prompt_ids, conversation, sampling, n=n)))
    refused = routes_start(engine, req, batches)
    if refused is not None:
        return error_response(refused)
    flight = engine.pauses.enter(response_id, batches, arrived, stream=bool(req.stream))
    if req.stream:
        lines = responses.completion_stream(engine.tokenizer, batches, opts, n, flight)
        return streamed(engine.pace, flight, lines)
    settled = await whole(engine.pace, request, flight)
    if settled is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONBytesResponse(responses.completion(engine.tokenizer, settled, opts, n))


async def tokenize(req: TokenizeRequest, request: Request) -> Response:
    engine = _engine(request)
    if req.messages is not None:
        ids = engine.chat_prompt_ids(req.messages, req.tools, req.add_generation_prompt)
    else:
        ids = engine.tokenizer.encode(req.prompt or "")
    strs = [engine.tokenizer.token_str(i) for i in ids] if req.return_token_strs else None
    return JSONBytesResponse(
        {
            "count": len(ids),
            "max_model_len": engine.settings.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(req: DetokenizeRequest, request: Request) -> Response:
    engine = _engine(request)
    refused = calls.out_of_vocabulary(engine, req.tokens)
    if refused is not None:
        return error_response(refused)
    return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})


async def update_weight_version(request: Request) -> Response:
    """vLLM 0.32's ``POST /update_weight_version`` (``new_version``; its RL routes, served
    with ``VLLM_SERVER_DEV_MODE=1``): sequences sampled from now on have that version. Its
    chat and completions replies do not report it; ``GET /weight_info`` does."""
    version = calls.new_weight_version(_engine(request), await request.body())
    if version is None:
        return error_response("new_version must be a non-empty string")
    return JSONBytesResponse({"success": True, "new_version": version})


async def weight_info(request: Request) -> dict:
    return {"weight_version": _engine(request).weight_version}


async def pause(
    request: Request,
    mode: Literal["abort", "wait", "keep"] = Query("abort"),
    clear_cache: bool = Query(True),  # vLLM's deprecated flag: accepted, nothing to clear
) -> Response:
    """Hold new requests; cut, drain or freeze the ones in flight (vLLM 0.32 ``/pause``)."""
    await _engine(request).pauses.pause(mode)
    return JSONBytesResponse({"status": "paused"})


async def resume(request: Request) -> Response:
    _engine(request).pauses.resume()
    return JSONBytesResponse({"status": "resumed"})


async def is_paused(request: Request) -> Response:
    return JSONBytesResponse({"is_paused": _engine(request).pauses.paused})


def _requests_counted(flights: list[Flight]) -> int:
    """Requests vLLM's frontend tracks for these: one per prompt, and per prompt asking for
    n > 1 a parent beside its n children."""
    return sum(len(gens) + (len(gens) > 1) for flight in flights for _, gens in flight.batches)


async def abort_requests(request: Request) -> Response:
    """Cut requests in flight without pausing (vLLM 0.32 ``/abort_requests``); it counts the
    ids it was given, or every request it tracks when given none."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return error_response("Invalid JSON format")
    if not isinstance(body, dict):
        return error_response("Request body must be a JSON object")
    request_ids = body.get("request_ids")
    if request_ids and not (
        isinstance(request_ids, list) and all(isinstance(i, str) for i in request_ids)
    ):
        return error_response("request_ids must be a list of strings")
    cut = await _engine(request).pauses.abort(request_ids or None, held=True)
    aborted = len(request_ids) if request_ids else _requests_counted(cut)
    return JSONBytesResponse({"status": "aborted", "aborted": aborted})


ROUTES = (
    ("/update_weight_version", update_weight_version, "POST"),
    ("/weight_info", weight_info, "GET"),
    ("/pause", pause, "POST"),
    ("/resume", resume, "POST"),
    ("/is_paused", is_paused, "GET"),
    ("/abort_requests", abort_requests, "POST"),
    ("/version", version, "GET"),
    ("/v1/models", models, "GET"),
    ("/v1/chat/completions", chat_completions, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/tokenize", tokenize, "POST"),
    ("/detokenize", detokenize, "POST"),
)
HANDLERS = (
    (RequestValidationError, _invalid),
    (ContextLengthError, _too_long),
    (ScriptedError, _scripted),
)


def needs_key(path: str) -> bool:
    """vLLM 0.10.2 checks ``--api-key`` on paths under ``/v1`` only (``/version``,
    ``/tokenize`` and the rest stay open)."""
    return path.startswith("/v1")
