"""One model call served while the harness waits: translate, dispatch, capture, reply.

The body is parsed and translated by the call's dialect (a bad one is a 400 in its shape),
the prompt built (faithful prompts), and the call's work (``api.call.work``: the engine,
then the capture) started as a task, so the handler watches the harness while it waits. A
call done within ``keepalive_s`` is answered whole, a failure as a plain HTTP error; a
streamed call not done by then, or relayed from its first delta, is answered by a
``KeptAliveStream``. Either way the final event goes out only over a durable record.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from api.call.stream import KeptAliveStream, settle
from api.call.traits import request_traits
from api.call.work import CallWork, Failed, run_call
from api.dialects.dialect import Dialect
from api.edge.body import release_body, take_body
from api.edge.errors import (
    BAD_REQUEST_ERRORS,
    CLIENT_CLOSED_REQUEST,
    UNAVAILABLE,
    bad_request,
    error_response,
)
from api.edge.hangup import client_gone
from api.edge.json_body import parse_json_object
from api.jsonbytes import JSONBytesResponse
from api.prompts.faithful import Prompt
from api.state import FrontEnd, front_end
from capture.context import current_call, mark_unreceived

# What the dialects' replies and streams read of a request body (never its history).
REPLY_FIELDS = (
    "model",
    "stream",
    "stream_options",
    "stop_sequences",
    "instructions",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_output_tokens",
)


async def serve_call(request: Request, dialect: Dialect) -> Response:
    """One model call: translate, call upstream, capture, reply (only over a durable record)."""
    front = front_end(request)
    try:
        full_body = parse_json_object(await take_body(request))
        chat_request = dialect.to_chat(full_body)
        traits = request_traits(full_body, chat_request)
        prompt = await _faithful_prompt(front, chat_request)
    except BAD_REQUEST_ERRORS as exc:
        front.metrics.record_call(dialect.NAME, "bad_request")
        return bad_request(dialect, exc)
    # The reply reads a few fields of the body; the history it carried is not kept.
    body = {key: full_body[key] for key in REPLY_FIELDS if key in full_body}
    del full_body
    release_body(request.scope)  # translated: what waits now is the upstream request
    head = dialect.reply_head(body)
    headers = {"x-tokcap-prompt": prompt.how} if prompt is not None else {}
    streamed = body.get("stream") is True
    relayed = streamed and await front.engines.can_relay(token_in=prompt is not None)
    work = CallWork(current_call(), asyncio.Queue() if relayed else None)
    work.task = asyncio.ensure_future(
        run_call(work, front, dialect.NAME, chat_request, traits, prompt, head["id"])
    )
    return await _answer(request, front, dialect, work, head, body, headers)


async def _answer(
    request: Request,
    front: FrontEnd,
    dialect: Dialect,
    work: CallWork,
    head: dict[str, Any],
    body: dict[str, Any],
    headers: dict[str, str],
) -> Response:
    """Wait for the call, then answer it: whole, as an error, or as a kept-alive stream."""
    streamed = body.get("stream") is True
    keepalive_s = front.settings.keepalive_s
    settled = await settle(work, request, keepalive_s if streamed else None)
    if settled == "gone":
        work.abandon(front.metrics)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # A stream opens at its first delta, or when not done in time (then kept alive).
    opened = settled in ("started", "waiting")
    outcome = None if opened else work.task.result()
    if isinstance(outcome, Failed):
        return error_response(dialect, outcome.status, outcome.message)
    if outcome is not None and outcome.outcome == "unrecorded":
        return error_response(dialect, 503, UNAVAILABLE)
    if streamed:
        metrics, keepalive = front.metrics, {"keepalive_s": keepalive_s, "opened": opened}
        return KeptAliveStream(
            work, dialect, head, body, request, metrics, **keepalive, headers=headers
        )
    assert outcome is not None
    reply = dialect.reply(outcome, body, head)
    if await client_gone(request):
        front.metrics.unreceived.inc()
        await mark_unreceived("the client disconnected before the reply was sent")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONBytesResponse(reply, headers=headers)


async def _faithful_prompt(front: FrontEnd, chat_request: dict[str, Any]) -> Prompt | None:
    """Faithful prompts: the ids this call sends, continuing the call its history ends in
    (``api.prompts.faithful``); None in text mode, where the engine renders the messages.
    The ``x-tokcap-prompt`` reply header says how the prompt was made."""
    if front.prompts is None:
        return None
    prompt = await front.prompts.build(chat_request)
    front.metrics.record_prompt(prompt.continued is not None, prompt.fallback)
    return prompt
