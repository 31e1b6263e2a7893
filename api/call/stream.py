"""One streamed reply, start to end, kept alive: ``KeptAliveStream``.

starlette's ``StreamingResponse`` sends what a generator yields and cancels it when the
client leaves; this class gives it the generator of one call's reply. A call not done
within ``keepalive_s`` has its stream opened (the dialect's opening events) and sends the
dialect's keep-alive every ``keepalive_s`` while it runs, so a harness's idle timeout never
fires while the engine queues, prefills or (relayed) samples; a relayed call's deltas go
out as they come. The final event goes out only once the call's entry (or the record of
its loss) is durable, and only to a harness still there; otherwise the stream ends with the
dialect's error event and the call counts as not served. A harness that leaves first
cancels the stream, and ``CallWork.abandon`` decides, without waiting, what becomes of
the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from api.call.work import CallWork, Failed
from api.dialects import sse
from api.dialects.dialect import Dialect, Relay
from api.edge.errors import UNAVAILABLE
from api.edge.hangup import client_gone, disconnected
from api.edge.metrics import FrontEndMetrics

# How a call stood when its handler stopped waiting: done, the harness gone, its first
# delta sampled (relayed), or still running after the keep-alive interval.
Settled = Literal["done", "gone", "started", "waiting"]


async def settle(work: CallWork, request: Request, timeout: float | None) -> Settled:
    """Wait for the work until it is done, the harness hangs up, its first delta comes, or
    ``timeout`` passes (a streamed call then opens its stream)."""
    gone = asyncio.ensure_future(disconnected(request))
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


class KeptAliveStream(StreamingResponse):
    """The server-sent events of one call's reply (see the module docstring).

    ``opened``: the call was not done when its handler stopped waiting, so the stream
    opens now and is kept alive until it is; else the finished reply is replayed whole.
    """

    def __init__(
        self,
        work: CallWork,
        dialect: Dialect,
        head: Mapping[str, Any],
        body: Mapping[str, Any],
        request: Request,
        metrics: FrontEndMetrics,
        *,
        keepalive_s: float,
        opened: bool,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # Not ``body``: a starlette response's body is what it sends.
        self.work, self.dialect, self.head, self.fields = work, dialect, head, body
        self.request, self.metrics = request, metrics
        self.keepalive_s = keepalive_s
        self.opened = opened
        relayed = opened and work.deltas is not None
        self.relay: Relay | None = dialect.Relay(head, body) if relayed else None
        super().__init__(
            self._events(),
            media_type="text/event-stream",
            headers={**(headers or {}), **sse.SSE_HEADERS},
        )

    async def _events(self) -> AsyncIterator[bytes]:
        """The generator resumes after its last yield only once the final event was sent."""
        dialect, work = self.dialect, self.work
        sent = 0
        delivered = False
        try:
            for event in dialect.opening(self.head, self.fields) if self.opened else ():
                yield event
                sent += 1
            async for event in self._while_running():
                yield event
                sent += event is not dialect.KEEPALIVE  # a keep-alive is no event of the reply
            outcome = work.task.result()
            if isinstance(outcome, Failed) or outcome.outcome == "unrecorded":
                status, message = (
                    (outcome.status, outcome.message)
                    if isinstance(outcome, Failed)
                    else (503, UNAVAILABLE)
                )
                yield dialect.stream_error(self.head, self.fields, status, message, sent)
                delivered = True  # the harness has its answer: the error, as it would a 502
                return
            reply = dialect.reply(outcome, self.fields, self.head)
            relay = self.relay
            ending = (
                relay.close(reply) if relay else dialect.events(reply, self.fields, self.opened)
            )
            *leading, final = ending
            for event in leading:
                yield event
            if not await client_gone(self.request):
                yield final
                delivered = True
        finally:
            if not delivered:
                work.abandon(self.metrics)

    async def _while_running(self) -> AsyncIterator[bytes]:
        """While the call runs: each delta's events as it comes (relayed), else a keep-alive
        whenever ``keepalive_s`` passes with nothing sent."""
        work, relay, deltas = self.work, self.relay, self.work.deltas
        while True:
            if relay is not None and deltas is not None and not deltas.empty():
                for event in relay.delta(deltas.get_nowait()):
                    yield event
                continue
            if work.task.done():
                return
            waiting: set[asyncio.Future[Any]] = {work.task}
            arrival = asyncio.ensure_future(work.started.wait()) if relay is not None else None
            if arrival is not None:
                work.started.clear()  # set again by the next delta
                waiting.add(arrival)
            try:
                finished, _ = await asyncio.wait(
                    waiting, timeout=self.keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if arrival is not None:
                    arrival.cancel()
            if not finished:
                yield self.dialect.KEEPALIVE
