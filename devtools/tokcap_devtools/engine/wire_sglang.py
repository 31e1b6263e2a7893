"""SGLang 0.5.23's routes, as the engine speaks them with ``wire="sglang"``.

Routes: ``POST /v1/chat/completions`` (SGLang's id and meta-info flags; a stream that asks
for ids is a 400), ``POST /generate`` (native, token-in), ``GET /v1/models`` (``owned_by:
"sglang"``, ``max_model_len``), ``GET /get_server_info`` and ``/server_info`` (``version``,
``context_length``), ``GET /get_model_info`` and ``/model_info``, ``GET /health_generate``.
There is no ``/version`` (SGLang has none), nor ``/v1/completions``, ``/tokenize`` or
``/detokenize`` here.

Weight updates: ``POST /update_weight_version``, and SGLang 0.5's pause routes
(``http_server.py``): ``POST /pause_generation`` (body ``{"mode": "abort" | "retract" |
"in_place"}``, optional here, ``abort`` by default; ``retract`` and ``in_place`` both freeze
the requests in flight, which go on after the resume) and ``POST /continue_generation``,
each answering 200 ``{"message": "Generation paused successfully." | "Generation continued
successfully.", "status": "ok"}``; ``POST /abort_request`` (``{"rid": ...}`` or ``{"abort_all":
true}``, an empty 200). A request held by the pause is not yet the scheduler's, so neither
cuts it. What a pause does to requests is ``tokcap_devtools.engine.pause``'s.

Errors on the OpenAI routes use SGLang's flat body ``{"object": "error", "message", "type",
"param", "code"}`` (``serving_base.py``); elsewhere ``{"error": {"message"}}``, as
``/generate`` answers. A request that does not fit is refused in SGLang's words
(``tokenizer_manager.py``).
"""

from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from api import JSONBytesResponse

from . import calls
from . import sglang_responses as replies
from .generation import ContextLengthError, Engine, SamplingParams, ScriptedError
from .pacing import CLIENT_CLOSED_REQUEST, streamed, whole
from .pause import ABORT, KEEP
from .sglang_protocol import GenerateRequest, GenerateSamplingParams, SGLangChatRequest

SGLANG_VERSION = "0.5.23"  # the SGLang release whose shapes this wire follows
# What the engine would be launched with to parse its own output (Qwen-style tool calls and
# <think> blocks); reported by the info routes as SGLang reports its flags.
TOOL_CALL_PARSER = "qwen25"
REASONING_PARSER = "qwen3"
_STATUSES = {status.value for status in HTTPStatus}


def openai_error(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def error_for(request: Request, message: str, status: int = 400, kind: str = "") -> JSONResponse:
    """The OpenAI routes' flat body, or the native routes' ``{"error": {"message"}}``."""
    if request.url.path.startswith("/v1/"):
        return openai_error(message, status, kind or "BadRequestError")
    return JSONResponse({"error": {"message": message}}, status_code=status)


def context_message(exc: ContextLengthError) -> str:
    """SGLang 0.5.23's words for a request that does not fit (``tokenizer_manager.py``)."""
    limit, prompt = exc.limit, exc.prompt_tokens
    if exc.requested is None:
        return (
            f"The input ({prompt} tokens) is longer than the model's context length "
            f"({limit} tokens)."
        )
    wanted = exc.requested
    return (
        f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
        f"You requested a total of {prompt + wanted} tokens: {prompt} tokens from the input "
        f"messages and {wanted} tokens for the completion. Please reduce the number of tokens "
        "in the input messages or the completion to fit within the limit."
    )


def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_for(request, str(exc.errors()))


async def _too_long(request: Request, exc: ContextLengthError) -> JSONResponse:
    return error_for(request, context_message(exc))


async def _scripted(request: Request, exc: ScriptedError) -> JSONResponse:
    kind = HTTPStatus(exc.status).phrase.replace(" ", "") if exc.status in _STATUSES else "Error"
    return error_for(request, exc.message, exc.status, kind)


async def health_generate() -> Response:
    return Response(status_code=200)


async def models(request: Request) -> dict:
    settings = _engine(request).settings
    card = {
        "id": settings.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": settings.model,
        "parent": None,
        "max_model_len": settings.max_model_len,
    }
    return {"object": "list", "data": [card]}


async def get_server_info(request: Request) -> dict:
    """A few of SGLang's server arguments and its version (never the API key, which SGLang
    itself would dump here)."""
    engine = _engine(request)
    settings = engine.settings
    return {
        "model_path": settings.model,
        "tokenizer_path": engine.tokenizer.name_or_path,
        "served_model_name": settings.model,
        "context_length": settings.max_model_len,
        "random_seed": settings.seed,
        "tool_call_parser": TOOL_CALL_PARSER,
        "reasoning_parser": REASONING_PARSER,
        "sampling_defaults": "model",
        "version": SGLANG_VERSION,
    }


async def server_info(request: Request) -> dict:
    return {**await get_server_info(request), "frontend": "python"}


async def get_model_info(request: Request) -> dict:
    engine = _engine(request)
    return {
        "model_path": engine.settings.model,
        "tokenizer_path": engine.tokenizer.name_or_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
    }


async def model_info(request: Request) -> dict:
    return {
        **await get_model_info(request),
        "served_model_name": _engine(request).settings.model,
        "reasoning_parser": REASONING_PARSER,
        "tool_call_parser": TOOL_CALL_PARSER,
    }


def _chat_reply(
    engine: Engine, req: SGLangChatRequest, rid: str, prompt_ids: list[int], started: float
) -> replies.SGLangReply:
    # --without-token-ids: an SGLang before 0.5.17, which ignores the flags it lacks.
    ids = engine.settings.token_id_fields
    return replies.SGLangReply(
        rid=rid,
        created=int(time.time()),
        model=req.model or "default",  # SGLang echoes the request's model name
        prompt_ids=prompt_ids,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        return_prompt_ids=ids and bool(req.return_token_ids or req.return_prompt_token_ids),
        return_output_ids=ids and bool(req.return_token_ids),
        meta_info=bool(req.return_meta_info),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        started=started,
        moe=engine.settings.moe if req.return_routed_experts else None,
    )


async def chat_completions(req: SGLangChatRequest, request: Request) -> Response:
    started, arrived = time.perf_counter(), time.monotonic()
    engine = _engine(request)
    refused = req.stream_refused_flag
    if refused is not None:
        return openai_error(
            f"{refused} is not supported with streaming on /v1/chat/completions. "
            f"Please set stream=false when using {refused}=true."
        )
    rid = uuid.uuid4().hex
    top = req.top_logprobs or 0
    # One alternative more than shown, so the k best are known even when the sampled
    # token is not among them (SGLang lists the k best, not the sampled one first).
    call = calls.run_chat(engine, req, top + 1 if top else 0)
    reply = _chat_reply(engine, req, rid, call.prompt_ids, started)
    flight = engine.pauses.enter(rid, call.batches, arrived, stream=bool(req.stream))
    if req.stream:
        lines = replies.chat_stream(engine.tokenizer, call.generations, reply, flight)
        return streamed(engine.pace, flight, lines)
    settled = await whole(engine.pace, request, flight)
    if settled is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    [(_, gens)] = settled
    return JSONBytesResponse(replies.chat_completion(engine.tokenizer, gens, reply))


def _generate_sampling(params: GenerateSamplingParams, top: int) -> SamplingParams:
    """``sampling_params`` as given: SGLang applies no generation config to ``/generate``."""
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_new_tokens,
        seed=params.sampling_seed,
        stop=params.stop_list,
        top_logprobs=top + 1 if top else 0,
    )


async def generate(req: GenerateRequest, request: Request) -> Response:
    started, arrived = time.perf_counter(), time.monotonic()
    engine = _engine(request)
    if req.input_ids is not None:
        refused = calls.out_of_vocabulary(engine, req.input_ids)
        if refused is not None:
            return error_for(request, refused)
    prompt = req.input_ids if req.input_ids is not None else req.text or ""
    prompt_ids, conversation = calls.token_prompt(engine, prompt)
    rid = req.rid or uuid.uuid4().hex
    sampling = _generate_sampling(req.sampling_params, req.top_logprobs_num)
    [gen] = engine.generate(prompt_ids, conversation, sampling)
    reply = replies.SGLangReply(
        rid=rid,
        created=int(time.time()),
        model=engine.settings.model,
        prompt_ids=prompt_ids,
        logprobs=req.return_logprob,
        top_logprobs=req.top_logprobs_num,
        started=started,
        moe=engine.settings.moe if req.return_routed_experts else None,
    )
    text = req.return_text_in_logprobs
    flight = engine.pauses.enter(rid, [(prompt_ids, [gen])], arrived, stream=req.stream)
    if req.stream:
        lines = replies.generate_stream(engine.tokenizer, gen, reply, text, flight)
        return streamed(engine.pace, flight, lines)
    settled = await whole(engine.pace, request, flight)
    if settled is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    [(_, [gen])] = settled
    return JSONBytesResponse(replies.generate(engine.tokenizer, gen, reply, text))


async def update_weight_version(request: Request) -> Response:
    """SGLang's ``POST /update_weight_version`` (``new_version``): calls sampled from now on
    report it; a request already sampled keeps the version it was sampled under. With
    ``abort_all_requests`` the requests in flight are cut first, as ``/abort_request`` does."""
    raw = await request.body()
    body = await _json_body(request)
    named = isinstance(body, dict) and isinstance(body.get("new_version"), str)
    if named and body["new_version"] and body.get("abort_all_requests"):
        await _engine(request).pauses.abort(None, held=False)
    version = calls.new_weight_version(_engine(request), raw)
    if version is None:
        return openai_error("new_version must be a non-empty string")
    return JSONBytesResponse({"success": True, "message": f"weight version set to {version}"})


# SGLang's pause modes, as the engine's: ``retract`` sends the running requests back to the
# waiting queue with what they generated, to go on (re-prefilled) after the resume.
PAUSE_MODES = {"abort": ABORT, "retract": KEEP, "in_place": KEEP}


async def _json_body(request: Request) -> dict | None:
    """The request's JSON object ({} when it has no body), or None when it is not one."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


async def pause_generation(request: Request) -> Response:
    """Hold new requests; cut or freeze the ones in flight (SGLang 0.5 ``/pause_generation``)."""
    body = await _json_body(request)
    mode = "abort" if body is None else body.get("mode", "abort")
    if body is None or not isinstance(mode, str) or mode not in PAUSE_MODES:
        allowed = list(PAUSE_MODES)
        return error_for(request, f"Invalid mode: {mode!r}. Expected one of {allowed}.")
    await _engine(request).pauses.pause(PAUSE_MODES[mode])
    return JSONBytesResponse({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    _engine(request).pauses.resume()
    return JSONBytesResponse({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: Request) -> Response:
    """Cut one request (``rid``) or all (``abort_all``) without pausing: an empty 200, as
    SGLang answers whether or not it found the request."""
    body = await _json_body(request)
    if body is None:
        return error_for(request, "the body must be a JSON object")
    rid = body.get("rid") or []
    rids = [r for r in (rid if isinstance(rid, list) else [rid]) if isinstance(r, str)]
    if body.get("abort_all") or rids:
        await _engine(request).pauses.abort(None if body.get("abort_all") else rids, held=False)
    return Response(status_code=200)


ROUTES = (
    ("/update_weight_version", update_weight_version, "POST"),
    ("/pause_generation", pause_generation, "POST"),
    ("/continue_generation", continue_generation, "POST"),
    ("/abort_request", abort_request, "POST"),
    ("/health_generate", health_generate, "GET"),
    ("/v1/models", models, "GET"),
    ("/v1/chat/completions", chat_completions, "POST"),
    ("/generate", generate, "POST"),
    ("/get_server_info", get_server_info, "GET"),
    ("/server_info", server_info, "GET"),
    ("/get_model_info", get_model_info, "GET"),
    ("/model_info", model_info, "GET"),
)
HANDLERS = (
    (RequestValidationError, _invalid),
    (ContextLengthError, _too_long),
    (ScriptedError, _scripted),
)


def needs_key(path: str) -> bool:
    """SGLang checks ``--api-key`` on every path, unknown ones too, but health and metrics."""
    return not path.startswith(("/health", "/metrics"))
