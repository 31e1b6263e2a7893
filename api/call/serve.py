"""One model call served while the harness waits: keep-alive, hang-ups, the final event.

The call's work (the engine, then the capture) runs in a task of its own, so the handler
watches the harness while it waits. A harness that hangs up before the engine answered
cancels the engine request (closing the connection is how vLLM and SGLang abort one): the
call's intent is voided and it counts as ``abandoned``. One that hangs up after lets the
capture finish, and the call is noted unreceived. A streamed call that is not done within
``keepalive_s`` opens its stream (the dialect's opening events) and sends the dialect's
keep-alive every ``keepalive_s`` until it is, so a harness's request timeout never fires
while the engine queues or prefills; a call done sooner is answered whole, a failure as a
plain HTTP error. Either way the final event goes out only once the call's entry (or the
record of its loss) is durable, and only to a harness still there; otherwise an open
stream ends with the dialect's error event and the call counts as not served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.call.capture import capture
from api.call.policy import stamped
from api.call.traits import request_traits, with_traits
from api.dialects import sse
from api.dialects.common import RequestError
from api.edge.body import RETRY_HEADERS, parse_json_object, release_body, take_body
from api.edge.hangup import client_gone
from api.edge.metrics import FrontEndMetrics
from api.engine.generation import Generation, UpstreamError
from api.jsonbytes import JSONBytesResponse
from api.prompts.faithful import FaithfulPrompts, Prompt
from api.types import Delta, ServedCall
from capture.context import (
    CallCapture,
    begin_call,
    current_call,
    mark_unreceived,
    resolve_unserved,
    void_call,
)

# nginx's status for a request whose client closed the connection first; nobody reads it.
CLIENT_CLOSED_REQUEST = 499
BAD_REQUEST_ERRORS = (RequestError, TypeError, ValueError, KeyError, AttributeError, RecursionError)
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
UNAVAILABLE = (
    "the token capture store could not record this call in time; the reply was withheld "
    "so the rollout stays exact: retry the request"
)


@dataclass(frozen=True)
class Dialect:
    """What makes one wire dialect: translation, the reply, its stream, its errors."""

    name: str
    to_chat: Callable[[Mapping[str, Any]], dict[str, Any]]
    reply_head: Callable[[Mapping[str, Any]], dict[str, Any]]
    reply: Callable[..., dict[str, Any]]
    opening: Callable[[Mapping[str, Any], Mapping[str, Any]], list[bytes]]
    events: Callable[[Mapping[str, Any], Mapping[str, Any], bool], list[bytes]]
    stream_error: Callable[..., bytes]
    keepalive: bytes
    error_body: Callable[[int, str], dict[str, Any]]
    relay: Callable[..., Any]  # the events of each delta as it comes (``Relay``)

    @classmethod
    def of(cls, module: Any) -> Dialect:
        return cls(
            module.NAME,
            module.to_chat,
            module.reply_head,
            module.reply,
            module.opening,
            module.events,
            module.stream_error,
            module.KEEPALIVE,
            module.error_body,
            module.Relay,
        )


@dataclass
class Failed:
    """The engine gave no usable reply: what the harness is told."""

    status: int
    message: str


@dataclass
class CallWork:
    """The call's work as a task, whether it is still waiting on the engine, and (relayed)
    the deltas the engine sampled so far, set ``started`` by the first of them."""

    call: CallCapture | None
    deltas: asyncio.Queue[Delta] | None = None
    generating: bool = True
    started: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[ServedCall | Failed] = field(init=False)


async def serve_call(request: Request, dialect: Dialect) -> Response:
    """One model call: translate, call upstream, capture, reply (only over a durable record)."""
    state = request.app.state
    metrics: FrontEndMetrics = state.metrics
    try:
        full_body = parse_json_object(await take_body(request))
        chat_request = dialect.to_chat(full_body)
        traits = request_traits(full_body, chat_request)
        prompt = await _faithful_prompt(state, chat_request)
    except BAD_REQUEST_ERRORS as exc:
        metrics.record_call(dialect.name, "bad_request")
        message = str(exc) if not isinstance(exc, RecursionError) else "request nested too deeply"
        return JSONResponse(dialect.error_body(400, message), status_code=400)
    # The reply reads a few fields of the body; the history it carried is not kept.
    body = {key: full_body[key] for key in REPLY_FIELDS if key in full_body}
    del full_body
    release_body(request.scope)  # translated: what waits now is the upstream request
    head = dialect.reply_head(body)
    headers = {"x-tokcap-prompt": prompt.how} if prompt is not None else {}
    streamed = body.get("stream") is True
    relayed = streamed and await _relayed(state, prompt)
    work = CallWork(current_call(), asyncio.Queue() if relayed else None)
    work.task = asyncio.ensure_future(
        _work(work, state, dialect, chat_request, traits, prompt, head["id"])
    )
    settled = await _settle(work, request, state.settings.keepalive_s if streamed else None)
    if settled == "gone":
        _abandon(work, metrics)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # A stream opens at its first delta, or when not done in time (then kept alive).
    opened = settled in ("started", "waiting")
    outcome = None if opened else work.task.result()
    if isinstance(outcome, Failed):
        return JSONResponse(dialect.error_body(outcome.status, outcome.message), outcome.status)
    if outcome is not None and outcome.outcome == "unrecorded":
        return JSONResponse(dialect.error_body(503, UNAVAILABLE), 503, headers=RETRY_HEADERS)
    if streamed:
        headers.update(sse.SSE_HEADERS)
        events = _stream(work, dialect, head, body, request, state, opened)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    assert outcome is not None
    reply = dialect.reply(outcome, body, head)
    if await client_gone(request):
        metrics.unreceived.inc()
        await mark_unreceived("the client disconnected before the reply was sent")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONBytesResponse(reply, headers=headers)


async def _faithful_prompt(state: Any, chat_request: dict[str, Any]) -> Prompt | None:
    """Faithful prompts: the ids this call sends, continuing the call its history ends in
    (``api.prompts.faithful``); None in text mode, where the engine renders the messages.
    The ``x-tokcap-prompt`` reply header says how the prompt was made."""
    prompts: FaithfulPrompts | None = state.prompts
    if prompts is None:
        return None
    prompt = await prompts.build(chat_request)
    state.metrics.record_prompt(prompt.continued is not None, prompt.fallback)
    return prompt


async def _relayed(state: Any, prompt: Prompt | None) -> bool:
    """Whether a streamed call is relayed as the engine samples it: text prompts (faithful
    replies are parsed from the whole sampled ids) and an engine whose stream carries every
    id (``UpstreamClient.can_relay``)."""
    return prompt is None and await state.upstream.can_relay()


async def _generate(
    state: Any, chat_request: dict[str, Any], prompt: Prompt | None, work: CallWork
) -> Generation:
    """One sampled reply: the engine renders the chat request (text mode; relayed, each
    delta queued for the stream as it arrives), or continues the prompt's ids token-in and
    the reply is read from the sampled ids (faithful mode)."""
    if work.deltas is not None:
        generation = None
        async for piece in state.upstream.chat_relay(chat_request):
            if isinstance(piece, Delta):
                work.deltas.put_nowait(piece)
                work.started.set()
            else:
                generation = piece
        assert generation is not None, "a relayed call ends with its generation"
        return generation
    if prompt is None:
        return await state.upstream.chat(chat_request)
    generation = await state.upstream.complete_ids(
        prompt.ids, prompt.sampling, chat_request.get("model")
    )
    return state.prompts.served(prompt, generation)


def _begin_call_while_dispatching() -> asyncio.Future[None] | None:
    """Write the call's intent while the engine works instead of before it.

    The intent does its job if it is durable before the call's reply can reach the harness:
    a freeze that lands before then sees the call pending, or makes ``begin_call`` fail,
    which marks the rollout incomplete, exactly as when the intent was written before
    dispatch. It is awaited before the capture step (so before the entry's put and before
    any reply), and before voiding a call that failed upstream or was abandoned.
    Untagged traffic has nothing to write: None.
    """
    if current_call() is None:
        return None
    return asyncio.ensure_future(begin_call())


async def _work(
    work: CallWork,
    state: Any,
    dialect: Dialect,
    chat_request: dict[str, Any],
    traits: dict[str, Any],
    prompt: Prompt | None,
    reply_id: str,
) -> ServedCall | Failed:
    """The engine, then the capture; the outcome the harness is answered with."""
    metrics: FrontEndMetrics = state.metrics
    intent = _begin_call_while_dispatching()
    dispatched_under = state.policy.current  # a version set while the engine works is not ours
    started = time.perf_counter()
    try:
        with state.collisions.watching(work.call, traits):
            generation = with_traits(await _generate(state, chat_request, prompt, work), traits)
            generation = stamped(generation, dispatched_under)
    except asyncio.CancelledError:  # the harness hung up: nothing reached it
        await _resolve_intent(intent)
        metrics.record_call(dialect.name, "abandoned")
        raise
    except Exception as exc:
        await _resolve_intent(intent)  # nothing reached the harness: not a loss
        metrics.record_call(dialect.name, "upstream_error")
        if isinstance(exc, UpstreamError):
            return Failed(exc.status, exc.message)
        return Failed(502, f"upstream call failed: {type(exc).__name__}: {exc}")
    finally:
        metrics.upstream_seconds.labels(dialect=dialect.name).observe(time.perf_counter() - started)
    work.generating = False
    if intent is not None:
        await intent  # durable before the entry, and so before any reply reaches the harness
    captured = await capture(generation, reply_id)
    metrics.record_call(dialect.name, captured.outcome, captured.put_seconds)
    if captured.outcome == "unrecorded":
        resolve_unserved("the call was answered 503, or its stream ended with an error")
    return captured


async def _resolve_intent(intent: asyncio.Future[None] | None) -> None:
    if intent is not None:
        await intent
    await void_call()


async def _disconnect(request: Request) -> None:
    """Returns once the harness closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _settle(work: CallWork, request: Request, timeout: float | None) -> str:
    """Wait for the work: "done", "gone" (the harness hung up first), "started" (its first
    delta came) or "waiting" (still running after ``timeout``)."""
    gone = asyncio.ensure_future(_disconnect(request))
    waiting = {work.task, gone}
    # Only a relayed call has deltas to start it.
    started = asyncio.ensure_future(work.started.wait()) if work.deltas is not None else None
    if started is not None:
        waiting.add(started)
    try:
        finished, _ = await asyncio.wait(
            waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        gone.cancel()
        if started is not None:
            started.cancel()
    if gone in finished:
        return "gone"
    if work.task in finished:
        return "done"
    return "started" if started in finished else "waiting"


async def _while_running(
    work: CallWork, relay: Any, keepalive: bytes, settings: Any
) -> AsyncIterator[bytes]:
    """While the call runs: each delta's events as it comes (relayed), else a keep-alive
    whenever ``keepalive_s`` passes with nothing sent."""
    deltas = work.deltas
    while True:
        if relay is not None and deltas is not None and not deltas.empty():
            for event in relay.delta(deltas.get_nowait()):
                yield event
            continue
        if work.task.done():
            return
        waiting = {work.task}
        arrival = asyncio.ensure_future(work.started.wait()) if relay is not None else None
        if arrival is not None:
            work.started.clear()  # set again by the next delta
            waiting.add(arrival)
        try:
            finished, _ = await asyncio.wait(
                waiting, timeout=settings.keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if arrival is not None:
                arrival.cancel()
        if not finished:
            yield keepalive


def _abandon(work: CallWork, metrics: FrontEndMetrics) -> None:
    """The harness left: cancel the engine request, or once the capture is done, note the
    reply unreceived. Nothing here waits: it may run in a cancelled stream."""
    if not work.task.done() and work.generating:
        work.task.cancel()
        return
    reason = "the client left before the reply, or the stream's final event"

    def unserved(task: asyncio.Task[Any]) -> None:
        outcome = None if task.cancelled() else task.result()
        if isinstance(outcome, ServedCall) and outcome.outcome != "unrecorded":
            metrics.unreceived.inc()
            resolve_unserved(reason, work.call)

    if work.task.done():
        unserved(work.task)
    else:
        work.task.add_done_callback(unserved)


async def _stream(
    work: CallWork,
    dialect: Dialect,
    head: dict[str, Any],
    body: Mapping[str, Any],
    request: Request,
    state: Any,
    opened: bool,
) -> AsyncIterator[bytes]:
    """The stream of a call: when ``opened`` (not done in time) the opening events first and
    a keep-alive every ``keepalive_s`` while the call runs; then its events, the final one
    only over a durable record and to a harness still there, or the dialect's error event.

    The generator resumes after its last yield only once the final event was sent. A
    harness that leaves first cancels the stream, and then ``_abandon`` decides, without
    waiting, what becomes of the call.
    """
    sent = 0
    delivered = False
    relay = dialect.relay(head, body) if opened and work.deltas is not None else None
    try:
        for event in dialect.opening(head, body) if opened else ():
            yield event
            sent += 1
        async for event in _while_running(work, relay, dialect.keepalive, state.settings):
            yield event
            sent += event is not dialect.keepalive  # a keep-alive is no event of the reply
        outcome = work.task.result()
        if isinstance(outcome, Failed):
            yield dialect.stream_error(head, body, outcome.status, outcome.message, sent)
            delivered = True  # the harness has its answer: the error, as it would a 502
            return
        if outcome.outcome == "unrecorded":
            yield dialect.stream_error(head, body, 503, UNAVAILABLE, sent)
            delivered = True  # not served, and already noted so (``_work``)
            return
        reply = dialect.reply(outcome, body, head)
        *leading, final = relay.close(reply) if relay else dialect.events(reply, body, opened)
        for event in leading:
            yield event
        if not await client_gone(request):
            yield final
            delivered = True
    finally:
        if not delivered:
            _abandon(work, state.metrics)
