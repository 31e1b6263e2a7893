"""Reply bodies in vLLM's OpenAI-compatible shapes (chat, completions, their SSE chunks).

Field names and presence follow vLLM >= 0.10.2: ``prompt_token_ids`` at the top of a chat
reply (and of the first stream chunk), ``token_ids`` per choice (and per chunk: the ids
that chunk adds), ``stop_reason`` beside ``finish_reason``, log-prob tokens as
``"token_id:N"`` when ``return_tokens_as_token_ids`` is set, -inf clamped to -9999.0.
Chat stream chunks carry only the fields vLLM sets on them (it dumps them with
exclude_unset); completion stream chunks carry every field, as vLLM dumps those in full.
A reply cut by a pause (vLLM 0.32's ``/pause?mode=abort`` or ``/abort_requests``) is a normal
reply of the tokens kept, finish reason ``abort`` and ``stop_reason`` null; a stream cut
midway ends at once with one chunk of finish reason ``abort`` and no tokens for each choice
still going, then its usage and ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from .generation import Generation
from .pause import Flight
from .routing import MoeShape, routes_of, vllm_routes
from .sampler import Step
from .tokenizer import EngineTokenizer


@dataclass(frozen=True)
class ReplyOptions:
    """What the request asked to see, beside the generations themselves."""

    response_id: str
    created: int
    model: str
    prompt_ids: list[int]
    logprobs: bool = False
    top_logprobs: int = 0
    as_token_ids: bool = False
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    id_fields: bool = True  # False: vLLM < 0.10.2, which has no token id fields at all
    moe: MoeShape | None = None  # routes per choice, as with --enable-return-routed-experts


_ID_FIELDS = ("prompt_token_ids", "token_ids")


def _without_id_fields(body: dict) -> dict:
    for key in _ID_FIELDS:
        body.pop(key, None)
    for choice in body.get("choices", []):
        for key in _ID_FIELDS:
            choice.pop(key, None)
    return body


def _routes(opts: ReplyOptions, prompt_ids: list[int], gen: Generation) -> str | None:
    """A choice's routes as vLLM 0.32 sends them (None unless the engine is an MoE): the
    positions from ``routed_experts_prompt_start`` on (``wire_vllm.routes_start``)."""
    if opts.moe is None:
        return None
    routes = routes_of([*prompt_ids, *gen.token_ids], opts.moe)
    return vllm_routes(routes[gen.routes_start or 0 :], opts.moe)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def token_label(tokenizer: EngineTokenizer, token_id: int, as_token_ids: bool) -> str:
    return f"token_id:{token_id}" if as_token_ids else tokenizer.token_text(token_id)


def _chat_logprob(tokenizer: EngineTokenizer, token_id: int, logprob: float, as_ids: bool) -> dict:
    token = token_label(tokenizer, token_id, as_ids)
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(tokenizer: EngineTokenizer, steps: list[Step], opts: ReplyOptions) -> dict:
    content = []
    for step in steps:
        entry = _chat_logprob(tokenizer, step.token_id, step.logprob, opts.as_token_ids)
        entry["top_logprobs"] = [
            _chat_logprob(tokenizer, tid, lp, opts.as_token_ids)
            for tid, lp in step.top[: opts.top_logprobs]
        ]
        content.append(entry)
    return {"content": content}


def message_content(gen: Generation) -> str | None:
    """Like vLLM: null beside tool calls or reasoning when nothing else was said."""
    if gen.parsed.tool_calls or gen.parsed.reasoning is not None:
        return gen.parsed.content
    return gen.parsed.content or ""


def chat_message(gen: Generation) -> dict:
    return {
        "role": "assistant",
        "content": message_content(gen),
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [call.as_openai() for call in gen.parsed.tool_calls],
        "reasoning_content": gen.parsed.reasoning,
    }


def chat_completion(tokenizer: EngineTokenizer, gens: list[Generation], opts: ReplyOptions) -> dict:
    choices = [
        {
            "index": gen.index,
            "message": chat_message(gen),
            "logprobs": chat_logprobs(tokenizer, gen.steps, opts) if opts.logprobs else None,
            "finish_reason": gen.finish_reason,
            "stop_reason": gen.stop_reason,
            "token_ids": list(gen.token_ids) if opts.return_token_ids else None,
            "routed_experts": _routes(opts, opts.prompt_ids, gen),
        }
        for gen in gens
    ]
    body = {
        "id": opts.response_id,
        "object": "chat.completion",
        "created": opts.created,
        "model": opts.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(len(opts.prompt_ids), sum(len(g.token_ids) for g in gens)),
        "prompt_logprobs": None,
        "prompt_token_ids": list(opts.prompt_ids) if opts.return_token_ids else None,
        "kv_transfer_params": None,
    }
    return body if opts.id_fields else _without_id_fields(body)


def _sse(payload: dict, opts: ReplyOptions) -> str:
    if not opts.id_fields:
        payload = _without_id_fields(payload)
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _overlap(text: str, start: int, end: int, span: tuple[int, int]) -> str:
    lo, hi = max(start, span[0]), min(end, span[1])
    return text[lo:hi] if lo < hi else ""


def _chat_delta(gen: Generation, start: int, end: int, emitted_calls: int) -> tuple[dict, int]:
    """The delta of the token covering text[start:end]; calls are sent when they close."""
    delta: dict = {}
    reasoning = _overlap(gen.text, start, end, gen.parsed.reasoning_span)
    if reasoning:
        delta["reasoning_content"] = reasoning
    content = _overlap(gen.text, start, end, gen.parsed.content_span)
    if content:
        delta["content"] = content
    calls = []
    while emitted_calls < len(gen.parsed.tool_calls):
        call = gen.parsed.tool_calls[emitted_calls]
        if call.end > end:
            break
        calls.append({"index": emitted_calls, **call.as_openai()})
        emitted_calls += 1
    if calls:
        delta["tool_calls"] = calls
    return delta, emitted_calls


def chat_deltas(gens: list[Generation]) -> Iterator[tuple[Generation, int, dict, bool]]:
    """Token by token, choices interleaved: (generation, position, delta, whether last).

    A stream sends one chunk per generated token, as vLLM does without a parser holding
    tokens back; the last token's delta carries whatever text the stop trimming left.
    """
    offsets = [0] * len(gens)
    emitted = [0] * len(gens)
    longest = max((len(g.token_ids) for g in gens), default=0)
    for position in range(longest):
        for n, gen in enumerate(gens):
            if position >= len(gen.token_ids):
                continue
            start = offsets[n]
            end = start + len(gen.deltas[position])
            offsets[n] = end
            last = position == len(gen.token_ids) - 1
            delta, emitted[n] = _chat_delta(gen, start, len(gen.text) if last else end, emitted[n])
            yield gen, position, delta, last


def _cut(flight: Flight | None) -> bool:
    """Whether a pause has cut the stream (asked before each token's line is built)."""
    return flight is not None and flight.cut


def chat_stream(
    tokenizer: EngineTokenizer,
    gens: list[Generation],
    opts: ReplyOptions,
    flight: Flight | None = None,
) -> Iterator[str]:
    """SSE lines of a chat completion stream, choices interleaved token by token."""
    head = {
        "id": opts.response_id,
        "object": "chat.completion.chunk",
        "created": opts.created,
        "model": opts.model,
    }
    prompt_len = len(opts.prompt_ids)
    for gen in gens:
        chunk = {
            **head,
            "choices": [
                {
                    "index": gen.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": list(opts.prompt_ids) if opts.return_token_ids else None,
        }
        if opts.continuous_usage:
            chunk["usage"] = usage(prompt_len, 0)
        yield _sse(chunk, opts)
    sent = {gen.index: 0 for gen in gens}
    for gen, position, delta, last in chat_deltas(gens):
        if _cut(flight):
            break
        choice = {
            "index": gen.index,
            "delta": delta,
            "logprobs": chat_logprobs(tokenizer, gen.steps[position : position + 1], opts)
            if opts.logprobs
            else None,
            "finish_reason": gen.finish_reason if last else None,
            "token_ids": [gen.token_ids[position]] if opts.return_token_ids else None,
        }
        if last:
            choice["stop_reason"] = gen.stop_reason
        chunk = {**head, "choices": [choice]}
        if opts.continuous_usage:
            chunk["usage"] = usage(prompt_len, position + 1)
        sent[gen.index] = position + 1
        if flight is not None:
            flight.note(gen.index, position + 1)
        yield _sse(chunk, opts)
    for gen in gens:
        if sent[gen.index] == len(gen.token_ids):
            continue  # that choice had ended (always, unless the stream was cut)
        choice = {
            "index": gen.index,
            "delta": {},
            "logprobs": chat_logprobs(tokenizer, [], opts) if opts.logprobs else None,
            "finish_reason": "abort",
            "token_ids": [] if opts.return_token_ids else None,
            "stop_reason": None,
        }
        chunk = {**head, "choices": [choice]}
        if opts.continuous_usage:
            chunk["usage"] = usage(prompt_len, sent[gen.index])
        yield _sse(chunk, opts)
    if opts.include_usage:
        total = sum(sent.values())
        yield _sse({**head, "choices": [], "usage": usage(prompt_len, total)}, opts)
    yield "data: [DONE]\n\n"


# -- /v1/completions --------------------------------------------------------------------
def completion_logprobs(
    tokenizer: EngineTokenizer,
    steps: list[Step],
    deltas: list[str],
    opts: ReplyOptions,
    offset: int = 0,
) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for step, delta in zip(steps, deltas, strict=True):
        tokens.append(token_label(tokenizer, step.token_id, opts.as_token_ids))
        token_logprobs.append(step.logprob)
        tops.append(
            {
                token_label(tokenizer, tid, opts.as_token_ids): lp
                for tid, lp in step.top[: max(1, opts.top_logprobs)]
            }
        )
        offsets.append(offset)
        offset += len(delta)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def completion(
    tokenizer: EngineTokenizer,
    batches: list[tuple[list[int], list[Generation]]],
    opts: ReplyOptions,
    n: int,
) -> dict:
    choices = []
    prompt_tokens = completion_tokens = 0
    for prompt_index, (prompt_ids, gens) in enumerate(batches):
        prompt_tokens += len(prompt_ids)
        for gen in gens:
            completion_tokens += len(gen.token_ids)
            choices.append(
                {
                    "index": prompt_index * n + gen.index,
                    "text": gen.text,
                    "logprobs": completion_logprobs(tokenizer, gen.steps, gen.deltas, opts)
                    if opts.logprobs
                    else None,
                    "finish_reason": gen.finish_reason,
                    "stop_reason": gen.stop_reason,
                    "token_ids": list(gen.token_ids) if opts.return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(prompt_ids) if opts.return_token_ids else None,
                    "routed_experts": _routes(opts, prompt_ids, gen),
                }
            )
    body = {
        "id": opts.response_id,
        "object": "text_completion",
        "created": opts.created,
        "model": opts.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
    }
    return body if opts.id_fields else _without_id_fields(body)


def completion_stream(
    tokenizer: EngineTokenizer,
    batches: list[tuple[list[int], list[Generation]]],
    opts: ReplyOptions,
    n: int,
    flight: Flight | None = None,
) -> Iterator[str]:
    """SSE lines of a completions stream, one choice after the other, token by token."""
    head = {
        "id": opts.response_id,
        "object": "text_completion",
        "created": opts.created,
        "model": opts.model,
    }
    choices = [
        (prompt_index * n + gen.index, prompt_ids, gen)
        for prompt_index, (prompt_ids, gens) in enumerate(batches)
        for gen in gens
    ]
    sent = {index: 0 for index, _, _ in choices}
    for index, prompt_ids, gen in choices:
        offset = 0
        for position, token_id in enumerate(gen.token_ids):
            if _cut(flight):
                break
            last = position == len(gen.token_ids) - 1
            delta = gen.deltas[position]
            choice = {
                "index": index,
                "text": delta,
                "logprobs": completion_logprobs(
                    tokenizer, gen.steps[position : position + 1], [delta], opts, offset
                )
                if opts.logprobs
                else None,
                "finish_reason": gen.finish_reason if last else None,
                "stop_reason": gen.stop_reason if last else None,
                "prompt_token_ids": list(prompt_ids)
                if opts.return_token_ids and position == 0
                else None,
                "token_ids": [token_id] if opts.return_token_ids else None,
            }
            offset += len(delta)
            chunk = {**head, "choices": [choice], "usage": None}
            if opts.continuous_usage:
                chunk["usage"] = usage(len(prompt_ids), position + 1)
            sent[index] = position + 1
            if flight is not None:
                flight.note(index, position + 1)
            yield _sse(chunk, opts)
    for index, prompt_ids, gen in choices:
        kept = sent[index]
        if kept == len(gen.token_ids):
            continue  # that choice had ended (always, unless the stream was cut)
        choice = {
            "index": index,
            "text": "",
            "logprobs": completion_logprobs(tokenizer, [], [], opts) if opts.logprobs else None,
            "finish_reason": "abort",
            "stop_reason": None,
            "prompt_token_ids": list(prompt_ids) if opts.return_token_ids and not kept else None,
            "token_ids": [] if opts.return_token_ids else None,
        }
        chunk = {**head, "choices": [choice], "usage": None}
        if opts.continuous_usage:
            chunk["usage"] = usage(len(prompt_ids), kept)
        yield _sse(chunk, opts)
    if opts.include_usage:
        prompt_tokens = sum(len(prompt_ids) for prompt_ids, _ in batches)
        totals = usage(prompt_tokens, sum(sent.values()))
        yield _sse({**head, "choices": [], "usage": totals}, opts)
    yield "data: [DONE]\n\n"
