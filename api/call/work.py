"""A call's work, as a task of its own: the engine, then the capture.

The handler watches the harness while this runs (``api.call.serve``), so a harness that
hangs up before the engine answered cancels the engine request (closing the connection is
how vLLM and SGLang abort one): the call's intent is voided and it counts as
``abandoned``. One that hangs up after lets the capture finish, and the call is noted
unreceived (``CallWork.abandon``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.call.capture import capture
from api.call.policy import stamped
from api.call.resume import Cut, continued, is_cut, refuse_cut
from api.call.traits import with_traits
from api.call.updates import Flight
from api.edge.metrics import FrontEndMetrics
from api.engine.client import UpstreamClient
from api.engine.generation import Generation, UpstreamError, with_changes
from api.engine.http import ROUTING_KEY
from api.prompts.faithful import Prompt
from api.prompts.relay import ParsedRelay
from api.prompts.route_prefix import chained, routes_start
from api.state import FrontEnd
from api.types import Delta, ServedCall
from capture.context import CallCapture, begin_call, current_call, resolve_unserved, void_call


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

    def abandon(self, metrics: FrontEndMetrics) -> None:
        """The harness left: cancel the engine request, or once the capture is done, note
        the reply unreceived. Nothing here waits: it may run in a cancelled stream."""
        if not self.task.done() and self.generating:
            self.task.cancel()
            return
        reason = "the client left before the reply, or the stream's final event"
        call = self.call

        def unserved(task: asyncio.Task[Any]) -> None:
            outcome = None if task.cancelled() else task.result()
            if isinstance(outcome, ServedCall) and outcome.outcome != "unrecorded":
                metrics.unreceived.inc()
                resolve_unserved(reason, call)

        if self.task.done():
            unserved(self.task)
        else:
            self.task.add_done_callback(unserved)


async def _served(
    front: FrontEnd, chat_request: dict[str, Any], prompt: Prompt | None, work: CallWork
) -> Generation:
    """The reply of the engine that holds the call's rollout (``api.engine.pool``), which
    its entry names: every part of the call goes to that engine."""
    rollout_id = work.call.rollout_id if work.call else None
    engine = front.engines.choose(rollout_id)
    ROUTING_KEY.set(rollout_id)  # this task's own context: a router keeps the rollout too
    async with front.engines.serving(engine) as client:
        generation = await _generate(front, client, chat_request, prompt, work)
    return with_changes(
        generation, entry_fields={**generation.entry_fields, "engine": engine.where}
    )


async def _generate(
    front: FrontEnd,
    client: UpstreamClient,
    chat_request: dict[str, Any],
    prompt: Prompt | None,
    work: CallWork,
) -> Generation:
    """One sampled reply with the version that sampled it: the engine renders the chat
    request (text mode; relayed, each delta queued for the stream as it arrives), or
    continues the prompt's ids token-in and the reply is read from the sampled ids
    (faithful mode; relayed, the settled parse of the ids so far queued as they come,
    then the rest of the whole parse). Each engine request goes out through
    ``WeightUpdates.sent``."""
    updates = front.updates
    if work.deltas is not None and prompt is None:
        generation, flight = await updates.sent(
            functools.partial(_relayed, client, chat_request, work), front.policy.now
        )
        return stamped(refuse_cut(generation), flight.version)
    if prompt is None:
        generation, flight = await updates.sent(
            lambda _flight: client.chat(chat_request), front.policy.now
        )
        return stamped(refuse_cut(generation), flight.version)
    assert front.prompts is not None, "a faithful prompt was built by the front end's prompts"
    relay = ParsedRelay(front.prompts.renderer, prompt) if work.deltas is not None else None
    start = routes_start(prompt.routes_prefix, client)
    model = chat_request.get("model")
    generation = await _token_in(front, client, prompt, model, work, relay, start)
    generation = await chained(generation, prompt.routes_prefix if start else None)
    served = front.prompts.served(prompt, generation)
    if relay is not None:
        _queued(work, relay.rest(served.message))
    return served


async def _relayed(
    client: UpstreamClient, chat_request: dict[str, Any], work: CallWork, flight: Flight
) -> Generation:
    """A relayed reply: each delta queued for the stream as it arrives (the first shows
    the engine sampling it), then the generation."""
    assert work.deltas is not None, "a relayed call has a stream to feed"
    generation = None
    async for piece in client.chat_relay(chat_request):
        if isinstance(piece, Delta):
            flight.started = True
            work.deltas.put_nowait(piece)
            work.started.set()
        else:
            generation = piece
    assert generation is not None, "a relayed call ends with its generation"
    return generation


def _queued(work: CallWork, delta: Delta) -> None:
    """A relayed delta on its way to the stream (the first one opens it)."""
    if delta and work.deltas is not None:
        work.deltas.put_nowait(delta)
        work.started.set()


async def _relayed_ids(
    upstream: UpstreamClient,
    ids: list[int],
    sampling: Mapping[str, Any],
    model: Any,
    work: CallWork,
    relay: ParsedRelay,
    flight: Flight,
) -> Generation:
    """A streamed token-in part: the parse of every id sampled so far (earlier parts' too)
    queued for the stream as it settles (``api.prompts.relay``), then the generation."""
    before = ids[len(relay.prompt.ids) :]  # what earlier parts sampled
    generation = None
    async for piece in upstream.complete_ids_relay(ids, sampling, model):
        if isinstance(piece, Generation):
            generation = piece
            continue
        flight.started = True  # the engine is sampling it: never sent again
        if relay.due():
            _queued(work, relay.advance(before + piece.sampled()))
    assert generation is not None, "a streamed token-in call ends with its generation"
    return generation


async def _token_in(
    front: FrontEnd,
    upstream: UpstreamClient,
    prompt: Prompt,
    model: Any,
    work: CallWork,
    relay: ParsedRelay | None,
    routes_start: int = 0,
) -> Generation:
    """A token-in call, continued where the engine cut it (``api.call.resume``); routes
    are not stitched, so a call that captures them fails instead. Relayed, each part
    streams (``_relayed_ids``; never with routes, which no stream carries).
    ``routes_start``: the routes are asked for from that position on
    (``api.prompts.route_prefix``).

    Each part carries the version it was sent under, except a continuation of a part cut
    while this worker knew of no pause: someone else paused the engine, which held the
    continuation until its own resume, so that part carries the version read on return."""
    updates = front.updates
    external = False  # the last part was cut by a pause this worker did not make

    async def complete(ids: list[int], sampling: Mapping[str, Any], start: int = 0) -> Generation:
        nonlocal external
        request = (
            functools.partial(_relayed_ids, upstream, ids, sampling, model, work, relay)
            if relay is not None
            else lambda _flight: upstream.complete_ids(ids, sampling, model, start)
        )
        generation, flight = await updates.sent(request, front.policy.now)
        trusted = not external
        external = is_cut(generation) and updates.pauses == flight.pauses and not updates.paused
        return stamped(generation, flight.version) if trusted else generation

    generation = await complete(prompt.ids, prompt.sampling, routes_start)
    if upstream.routed_experts or not front.settings.resume_cut_calls:
        return refuse_cut(generation)
    version_now = functools.partial(_version_now, front)
    whole = await continued(generation, prompt.ids, prompt.sampling, complete, version_now)
    front.metrics.record_resumes(whole.resumes)
    return whole


async def _version_now(front: FrontEnd) -> str | None:
    """The policy version in force now, read again from the store."""
    with contextlib.suppress(Exception):  # an outage keeps the version last read
        await front.policy.refresh()
    return front.policy.current


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


async def _resolve_intent(intent: asyncio.Future[None] | None) -> None:
    if intent is not None:
        await intent
    await void_call()


async def run_call(
    work: CallWork,
    front: FrontEnd,
    dialect: str,
    chat_request: dict[str, Any],
    traits: dict[str, Any],
    prompt: Prompt | None,
    reply_id: str,
) -> ServedCall | Failed:
    """The engine, then the capture; the outcome the harness is answered with."""
    metrics = front.metrics
    intent = _begin_call_while_dispatching()
    started = time.perf_counter()
    try:
        with front.collisions.watching(work.call, traits):
            generation = with_traits(await _served(front, chat_request, prompt, work), traits)
    except asyncio.CancelledError:  # the harness hung up: nothing reached it
        await _resolve_intent(intent)
        metrics.record_call(dialect, "abandoned")
        raise
    except Exception as exc:
        await _resolve_intent(intent)  # nothing reached the harness: not a loss
        metrics.record_call(dialect, "cut" if isinstance(exc, Cut) else "upstream_error")
        if isinstance(exc, Cut):
            metrics.cut_calls.labels(outcome="failed").inc()
        if isinstance(exc, UpstreamError):
            return Failed(exc.status, exc.message)
        return Failed(502, f"upstream call failed: {type(exc).__name__}: {exc}")
    finally:
        seconds = time.perf_counter() - started
        metrics.labelled(metrics.upstream_seconds, dialect).observe(seconds)
    work.generating = False
    if intent is not None:
        await intent  # durable before the entry, and so before any reply reaches the harness
    captured = await capture(generation, reply_id)
    metrics.record_call(dialect, captured.outcome, captured.put_seconds)
    if captured.outcome == "unrecorded":
        resolve_unserved("the call was answered 503, or its stream ended with an error")
    return captured
