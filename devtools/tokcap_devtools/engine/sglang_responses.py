"""Reply bodies in SGLang 0.5.23's shapes: chat completions (whole and streamed), ``/generate``.

Where SGLang's replies differ from vLLM's (``python/sglang/srt/entrypoints/openai/
protocol.py`` ``ChatCompletionResponseChoice``, ``serving_chat.py``; ``managers/
tokenizer_manager.py`` for ``/generate`` and ``meta_info``):

- the reply ``id`` is the request id itself, without ``chatcmpl-``;
- ids are per choice: ``prompt_token_ids`` and ``response_token_ids``, each only when asked
  for and left out of the JSON otherwise, never at the top level and never in a stream;
- ``matched_stop`` says what ended a sequence: the end-of-sequence id or the stop string;
- log-probs are ``[logprob, id, text]`` triples in ``meta_info.output_token_logprobs``, and
  in ``logprobs.content`` the token is its decoded text with its own bytes (there is no
  ``token_id:N`` form); a log-prob of -inf is written as ``null``, not clamped to -9999.0;
- ``usage`` adds ``reasoning_tokens``; the reply adds ``metadata.weight_version``.

A request cut by a pause (``/pause_generation`` in ``abort`` mode, ``/abort_request``) is
answered with the tokens kept and the finish reason of an aborted request: ``meta_info.
finish_reason`` is ``{"type": "abort", "message": "Aborted", ...}`` (``FINISH_ABORT``, set on a
running request by ``scheduler.py`` ``abort_request``), or ``{"type": "abort", "message":
"Abort before prefill"}`` when it had generated nothing (``tokenizer_manager.py``
``_handle_abort_req``); chat says ``finish_reason: "abort"``. A cut stream ends at once: chat
with one ``abort`` chunk per choice still going, ``/generate`` with one last event of
everything kept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .generation import Generation
from .pause import Flight
from .responses import chat_deltas, message_content
from .routing import MoeShape, routes_of, sglang_routes
from .sampler import FLOOR, Step
from .tokenizer import EngineTokenizer

WEIGHT_VERSION = "default"
THINK_END = "</think>"


@dataclass(frozen=True)
class SGLangReply:
    """What the request asked to see, beside the generations themselves."""

    rid: str
    created: int
    model: str
    prompt_ids: list[int]
    logprobs: bool = False
    top_logprobs: int = 0
    return_prompt_ids: bool = False
    return_output_ids: bool = False
    meta_info: bool = False
    include_usage: bool = False
    started: float = 0.0  # time.perf_counter() when the request arrived
    # Routes in the final meta_info: an MoE engine asked for them (return_routed_experts).
    moe: MoeShape | None = None


def logprob_value(logprob: float) -> float | None:
    """SGLang writes -inf as null; the pseudo-model's floor stands for -inf."""
    return None if logprob <= FLOOR else logprob


def _triple(tokenizer: EngineTokenizer, token_id: int, logprob: float, text: bool) -> list:
    return [logprob_value(logprob), token_id, tokenizer.token_text(token_id) if text else None]


def _top(step: Step, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens, best first (SGLang ranks them; vLLM puts the sampled first)."""
    return sorted(step.top, key=lambda pair: -pair[1])[:k]


def finish_reason(tokenizer: EngineTokenizer, gen: Generation) -> dict:
    """The engine's own finish reason (``schedule_batch.py``): what matched, the length, or
    the abort of a request cut by a pause."""
    if gen.finish_reason == "abort":
        if not gen.token_ids:
            return {"type": "abort", "message": "Abort before prefill"}
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    if gen.stop_reason is not None:
        return {"type": "stop", "matched": gen.stop_reason}
    if gen.token_ids and gen.token_ids[-1] == tokenizer.eos_id:
        return {"type": "stop", "matched": tokenizer.eos_id}
    return {"type": "length", "length": len(gen.token_ids)}


def reasoning_tokens(tokenizer: EngineTokenizer, gen: Generation) -> int:
    """Generated tokens up to and including ``</think>`` (all of them if it never closed)."""
    if gen.parsed.reasoning is None:
        return 0
    end = tokenizer.token_to_id(THINK_END)
    ids = gen.token_ids
    return ids.index(end) + 1 if end in ids else len(ids)


def usage(prompt_tokens: int, completion_tokens: int, reasoning: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": reasoning,
    }


def meta_info(
    tokenizer: EngineTokenizer, gen: Generation, reply: SGLangReply, text: bool, upto: int
) -> dict:
    """The engine's ``meta_info`` after ``upto`` generated tokens (a stream sends it growing)."""
    done = upto == len(gen.token_ids)
    info: dict = {
        "id": reply.rid,
        "finish_reason": finish_reason(tokenizer, gen) if done else None,
        "prompt_tokens": len(reply.prompt_ids),
        "weight_version": gen.weight_version,
        "completion_tokens": upto,
        "cached_tokens": 0,
    }
    if reply.logprobs:
        steps = gen.steps[:upto]
        info["output_token_logprobs"] = [
            _triple(tokenizer, s.token_id, s.logprob, text) for s in steps
        ]
        if reply.top_logprobs:
            info["output_top_logprobs"] = [
                [_triple(tokenizer, t, lp, text) for t, lp in _top(s, reply.top_logprobs)]
                for s in steps
            ]
    if reply.moe is not None and done:
        routes = routes_of([*reply.prompt_ids, *gen.token_ids], reply.moe)
        info["routed_experts"] = sglang_routes(routes)
    info["e2e_latency"] = round(time.perf_counter() - reply.started, 6)
    return info


# -- /v1/chat/completions ---------------------------------------------------------------
def _logprob_entry(tokenizer: EngineTokenizer, token_id: int, logprob: float) -> dict:
    return {
        "token": tokenizer.token_text(token_id),
        "bytes": list(tokenizer.token_bytes[token_id]),
        "logprob": logprob_value(logprob),
    }


def chat_logprobs(tokenizer: EngineTokenizer, steps: list[Step], top_logprobs: int) -> dict:
    content = []
    for step in steps:
        entry = _logprob_entry(tokenizer, step.token_id, step.logprob)
        entry["top_logprobs"] = [
            _logprob_entry(tokenizer, t, lp) for t, lp in _top(step, top_logprobs)
        ]
        content.append(entry)
    return {"content": content}


def _tool_calls(gen: Generation) -> list[dict] | None:
    calls = [{"index": i, **c.as_openai()} for i, c in enumerate(gen.parsed.tool_calls)]
    return calls or None


def chat_message(gen: Generation) -> dict:
    return {
        "role": "assistant",
        "content": message_content(gen),
        "reasoning_content": gen.parsed.reasoning,
        "tool_calls": _tool_calls(gen),
    }


def matched_stop(tokenizer: EngineTokenizer, gen: Generation) -> int | str | None:
    """What ended the sequence; none once the parser turned it into tool calls."""
    if gen.parsed.tool_calls:
        return None
    return finish_reason(tokenizer, gen).get("matched")


def _chat_choice(tokenizer: EngineTokenizer, gen: Generation, reply: SGLangReply) -> dict:
    choice = {
        "index": gen.index,
        "message": chat_message(gen),
        "logprobs": chat_logprobs(tokenizer, gen.steps, reply.top_logprobs)
        if reply.logprobs
        else None,
        "finish_reason": gen.finish_reason,
        "matched_stop": matched_stop(tokenizer, gen),
    }
    if reply.return_prompt_ids:
        choice["prompt_token_ids"] = list(reply.prompt_ids)
    if reply.return_output_ids:
        choice["response_token_ids"] = list(gen.token_ids)
    if reply.meta_info:
        choice["meta_info"] = meta_info(tokenizer, gen, reply, True, len(gen.token_ids))
    return choice


def chat_completion(tokenizer: EngineTokenizer, gens: list[Generation], reply: SGLangReply) -> dict:
    completion = sum(len(g.token_ids) for g in gens)
    reasoning = sum(reasoning_tokens(tokenizer, g) for g in gens)
    return {
        "id": reply.rid,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [_chat_choice(tokenizer, gen, reply) for gen in gens],
        "usage": usage(len(reply.prompt_ids), completion, reasoning),
        "metadata": {"weight_version": gens[0].weight_version if gens else WEIGHT_VERSION},
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _delta(fields: dict) -> dict:
    return {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **fields}


def chat_stream(
    tokenizer: EngineTokenizer,
    gens: list[Generation],
    reply: SGLangReply,
    flight: Flight | None = None,
) -> Iterator[str]:
    """SSE chunks of a chat stream: text and log-probs token by token, no ids at all."""
    head = {
        "id": reply.rid,
        "object": "chat.completion.chunk",
        "created": reply.created,
        "model": reply.model,
    }
    for gen in gens:
        first = {"index": gen.index, "delta": _delta({"role": "assistant", "content": ""})}
        choice = {**first, "logprobs": None, "finish_reason": None, "matched_stop": None}
        yield _sse({**head, "choices": [choice], "usage": None})
    sent = {gen.index: 0 for gen in gens}
    for gen, position, delta, last in chat_deltas(gens):
        if flight is not None and flight.cut:
            break
        step = gen.steps[position : position + 1]
        choice = {
            "index": gen.index,
            "delta": _delta(delta),
            "logprobs": chat_logprobs(tokenizer, step, reply.top_logprobs)
            if reply.logprobs
            else None,
            "finish_reason": gen.finish_reason if last else None,
            "matched_stop": matched_stop(tokenizer, gen) if last else None,
        }
        sent[gen.index] = position + 1
        if flight is not None:
            flight.note(gen.index, position + 1)
        yield _sse({**head, "choices": [choice], "usage": None})
    kept = [
        gen.cut(sent[gen.index]) if sent[gen.index] < len(gen.token_ids) else gen for gen in gens
    ]
    for gen in kept:
        if gen.finish_reason != "abort":
            continue  # that choice had ended (always, unless the stream was cut)
        choice = {
            "index": gen.index,
            "delta": _delta({}),
            "logprobs": None,
            "finish_reason": "abort",
            "matched_stop": None,
        }
        yield _sse({**head, "choices": [choice], "usage": None})
    if reply.include_usage:
        completion = sum(len(g.token_ids) for g in kept)
        reasoning = sum(reasoning_tokens(tokenizer, g) for g in kept)
        totals = usage(len(reply.prompt_ids), completion, reasoning)
        yield _sse({**head, "choices": [], "usage": totals})
    yield "data: [DONE]\n\n"


# -- /generate --------------------------------------------------------------------------
def generate(tokenizer: EngineTokenizer, gen: Generation, reply: SGLangReply, text: bool) -> dict:
    """``text`` (stop string and end token trimmed), ``output_ids`` (end token kept)."""
    return {
        "text": gen.text,
        "output_ids": list(gen.token_ids),
        "meta_info": meta_info(tokenizer, gen, reply, text, len(gen.token_ids)),
    }


def generate_stream(
    tokenizer: EngineTokenizer,
    gen: Generation,
    reply: SGLangReply,
    text: bool,
    flight: Flight | None = None,
) -> Iterator[str]:
    """One event per token with everything so far, as SGLang 0.5.23 streams by default."""
    shown = ""
    for position in range(len(gen.token_ids)):
        if flight is not None and flight.cut:
            kept = gen.cut(position)  # the tokens sent, once more, with the abort
            yield _sse(generate(tokenizer, kept, reply, text))
            break
        upto = position + 1
        shown += gen.deltas[position]
        if flight is not None:
            flight.note(0, upto)
        yield _sse(
            {
                "text": shown,
                "output_ids": gen.token_ids[:upto],
                "meta_info": meta_info(tokenizer, gen, reply, text, upto),
            }
        )
    yield "data: [DONE]\n\n"
