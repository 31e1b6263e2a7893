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


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or EngineSettings()
    engine = Engine(settings)
    tokenizer = engine.tokenizer
    app = FastAPI(title="tokcap engine", version="0.1.0")
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(str(exc.errors()))

    @app.exception_handler(ContextLengthError)
    async def _too_long(_: Request, exc: ContextLengthError) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(ScriptedError)
    async def _scripted(_: Request, exc: ScriptedError) -> JSONResponse:
        kind = (
            HTTPStatus(exc.status).phrase.replace(" ", "") if exc.status in _STATUSES else "Error"
        )
        return error_response(exc.message, exc.status, kind)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VLLM_VERSION if settings.token_id_fields else LEGACY_VLLM_VERSION}

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        card = {
            "id": settings.model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": settings.model,
            "parent": None,
            "max_model_len": settings.max_model_len,
            "permission": [
                {
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
            ],
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        tools = req.tools or None
        tool_choice = req.effective_tool_choice
        prompt_ids = tokenizer.encode(
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
                responses.chat_stream(tokenizer, gens, opts), media_type="text/event-stream"
            )
        return JSONBytesResponse(responses.chat_completion(tokenizer, gens, opts))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompts = req.prompts
        if not prompts:
            return error_response("prompt must not be empty")
        top = req.logprobs or 0
        first_ids = prompts[0] if isinstance(prompts[0], list) else tokenizer.encode(prompts[0])
        opts = _options(engine, req, "cmpl", first_ids, req.logprobs is not None, top)
        sampling = _sampling(engine, req, req.max_tokens, max(1, top))
        batches = []
        for prompt in prompts:
            if isinstance(prompt, list):
                if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
                    return error_response(
                        f"token id out of vocabulary (0..{tokenizer.vocab_size - 1})"
                    )
                prompt_ids, text = list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
            else:
                prompt_ids, text = tokenizer.encode(prompt), prompt
            messages = messages_from_prompt(text) or [{"role": "user", "content": text}]
            conversation = Conversation(messages, tools_from_prompt(text))
            gens = engine.generate(
                prompt_ids, conversation, sampling, n=req.n or 1, request_id=opts.response_id
            )
            batches.append((prompt_ids, gens))
        n = req.n or 1
        if req.stream:
            return StreamingResponse(
                responses.completion_stream(tokenizer, batches, opts, n),
                media_type="text/event-stream",
            )
        return JSONBytesResponse(responses.completion(tokenizer, batches, opts, n))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        if req.messages is not None:
            text = engine.render_chat(req.messages, req.tools, req.add_generation_prompt)
        else:
            text = req.prompt or ""
        ids = tokenizer.encode(text)
        strs = [tokenizer.hf.id_to_token(i) for i in ids] if req.return_token_strs else None
        return JSONBytesResponse(
            {
                "count": len(ids),
                "max_model_len": settings.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if any(not 0 <= t < tokenizer.vocab_size for t in req.tokens):
            return error_response(f"token id out of vocabulary (0..{tokenizer.vocab_size - 1})")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokcap/ground_truth")
    async def ground_truth() -> Response:
        return Response(engine.ground_truth.json_text(), media_type="application/json")

    @app.delete("/tokcap/ground_truth")
    async def clear_ground_truth() -> Response:
        engine.ground_truth.clear()
        return Response(status_code=204)

    return app
