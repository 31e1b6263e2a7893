"""The tokcap engine's HTTP app: vLLM's OpenAI-compatible routes plus the ground truth.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``, ``GET /health``, ``GET /version``, and
``GET``/``DELETE /tokcap/ground_truth`` (every sampled sequence, for tests and the demo).
Errors use vLLM's body ``{"error": {"message", "type", "param", "code"}}``; an invalid
body is a 400, as in vLLM, not FastAPI's 422. Any ``model`` name is accepted (vLLM would
answer 404 for a name it does not serve); replies carry the served name.
"""

from __future__ import annotations

import time
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.jsonbytes import JSONBytesResponse

from . import responses
from .generation import ContextLengthError, Engine, SamplingParams, ScriptedError
from .policies import Conversation
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from .settings import EngineSettings
from .template import messages_from_prompt, tools_from_prompt

_STATUSES = {status.value for status in HTTPStatus}
VLLM_VERSION = "0.10.2"  # the vLLM release whose OpenAI server shapes this engine follows
# What /version says while token_id_fields is off: a vLLM from before return_token_ids, so a
# client reading the version (api.upstream) takes the engine for the old one it emulates.
LEGACY_VLLM_VERSION = "0.10.1"


def error_response(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _sampling(
    engine: Engine, req: SamplingFields, max_tokens: int | None, top: int
) -> SamplingParams:
    defaults = engine.settings.generation_config
    return SamplingParams(
        temperature=req.temperature
        if req.temperature is not None
        else defaults.get("temperature", 1.0),
        top_p=req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
        max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
        seed=req.seed,
        stop=req.stop_list,
        top_logprobs=top,
    )


def _options(
    engine: Engine,
    req: SamplingFields,
    prefix: str,
    prompt_ids: list[int],
    logprobs: bool,
    top_logprobs: int,
) -> responses.ReplyOptions:
    stream_options = req.stream_options
    return responses.ReplyOptions(
        response_id=f"{prefix}-{uuid.uuid4().hex}",
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
    )


def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(str(exc.errors()))


async def _too_long(_: Request, exc: ContextLengthError) -> JSONResponse:
    return error_response(str(exc))


async def _scripted(_: Request, exc: ScriptedError) -> JSONResponse:
    kind = HTTPStatus(exc.status).phrase.replace(" ", "") if exc.status in _STATUSES else "Error"
    return error_response(exc.message, exc.status, kind)


async def health() -> Response:
    return Response(status_code=200)


async def version(request: Request) -> dict:
    fields = _engine(request).settings.token_id_fields
    return {"version": VLLM_VERSION if fields else LEGACY_VLLM_VERSION}


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
    engine = _engine(request)
    tools = req.tools or None
    tool_choice = req.effective_tool_choice
    prompt_ids = engine.tokenizer.encode(
        engine.render_chat(req.messages, tools, req.add_generation_prompt)
    )
    conversation = Conversation(req.messages, tools or [], tools_allowed=tool_choice != "none")
    top = req.top_logprobs or 0
    opts = _options(engine, req, "chatcmpl", prompt_ids, bool(req.logprobs), top)
    gens = engine.generate(
        prompt_ids,
        conversation,
        _sampling(engine, req, req.effective_max_tokens, top),
        n=req.n or 1,
        tool_choice=tool_choice,
        parse_tools=bool(tools) and tool_choice != "none",
        request_id=opts.response_id,
    )
    if req.stream:
        return StreamingResponse(
            responses.chat_stream(engine.tokenizer, gens, opts), media_type="text/event-stream"
        )
    return JSONBytesResponse(responses.chat_completion(engine.tokenizer, gens, opts))


def _out_of_vocabulary(engine: Engine, ids: list[int]) -> JSONResponse | None:
    vocab = engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        return error_response(f"token id out of vocabulary (0..{vocab - 1})")
    return None


def _completion_prompt(engine: Engine, prompt: str | list[int]) -> tuple[list[int], Conversation]:
    """A completions prompt (text or ids), and the conversation the policy reads from it."""
    tokenizer = engine.tokenizer
    if isinstance(prompt, list):
        prompt_ids, text = list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    else:
        prompt_ids, text = tokenizer.encode(prompt), prompt
    messages = messages_from_prompt(text) or [{"role": "user", "content": text}]
    return prompt_ids, Conversation(messages, tools_from_prompt(text))


async def completions(req: CompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    prompts = req.prompts
    if not prompts:
        return error_response("prompt must not be empty")
    for prompt in prompts:
        refused = _out_of_vocabulary(engine, prompt) if isinstance(prompt, list) else None
        if refused is not None:
            return refused
    top = req.logprobs or 0
    first = prompts[0]
    first_ids = first if isinstance(first, list) else engine.tokenizer.encode(first)
    opts = _options(engine, req, "cmpl", first_ids, req.logprobs is not None, top)
    sampling = _sampling(engine, req, req.max_tokens, max(1, top))
    n = req.n or 1
    batches = []
    for prompt in prompts:
        prompt_ids, conversation = _completion_prompt(engine, prompt)
        gens = engine.generate(prompt_ids, conversation, sampling, n=n, request_id=opts.response_id)
        batches.append((prompt_ids, gens))
    if req.stream:
        return StreamingResponse(
            responses.completion_stream(engine.tokenizer, batches, opts, n),
            media_type="text/event-stream",
        )
    return JSONBytesResponse(responses.completion(engine.tokenizer, batches, opts, n))


async def tokenize(req: TokenizeRequest, request: Request) -> Response:
    engine = _engine(request)
    if req.messages is not None:
        text = engine.render_chat(req.messages, req.tools, req.add_generation_prompt)
    else:
        text = req.prompt or ""
    ids = engine.tokenizer.encode(text)
    hf = engine.tokenizer.hf
    strs = [hf.id_to_token(i) for i in ids] if req.return_token_strs else None
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
    refused = _out_of_vocabulary(engine, req.tokens)
    if refused is not None:
        return refused
    return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})


async def ground_truth(request: Request) -> Response:
    return Response(_engine(request).ground_truth.json_text(), media_type="application/json")


async def clear_ground_truth(request: Request) -> Response:
    _engine(request).ground_truth.clear()
    return Response(status_code=204)


ROUTES = (
    ("/health", health, "GET"),
    ("/version", version, "GET"),
    ("/v1/models", models, "GET"),
    ("/v1/chat/completions", chat_completions, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/tokenize", tokenize, "POST"),
    ("/detokenize", detokenize, "POST"),
    ("/tokcap/ground_truth", ground_truth, "GET"),
    ("/tokcap/ground_truth", clear_ground_truth, "DELETE"),
)


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    app = FastAPI(title="tokcap engine", version="0.1.0")
    app.state.engine = Engine(settings or EngineSettings())
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(ContextLengthError, _too_long)
    app.add_exception_handler(ScriptedError, _scripted)
    for path, endpoint, method in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    return app
