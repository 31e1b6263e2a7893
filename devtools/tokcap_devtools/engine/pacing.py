"""How long a reply takes: the engine paced like a real one under load, held by a pause,
and its aborts.

A real engine answers once it has queued and prefilled the prompt (the time to the first
token), then one token at a time. ``first_token_s`` and ``token_s`` (``--first-token-s``,
``--token-s``) make the tokcap engine take as long: a whole reply waits for both, a stream
sends its first chunk after the first and each later one after the second. Each request is
a ``Flight`` (``tokcap_devtools.engine.pause``): held while the engine is paused, its clock
frozen or the request cut by a pause, and its ground truth written once its fate is known
(at once when the engine is not paced). A client that disconnects meanwhile aborts the
request, as vLLM aborts one whose client left (its serving code listens for the
disconnect); each abort is kept with the time since the request arrived, served at ``GET
/tokcap/aborted`` beside the ground truth, so tests can check that a front end cancels what
its harness abandoned; ``GET /tokcap/pace`` says how many requests it is waiting out now and
the most at once (how many calls a front end let through).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from .pause import Batches, Flight

# The last line of every stream, on both wires: once it is due, the stream's fate is known.
SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Pace:
    """The engine's timing, and the requests aborted while it waited."""

    first_token_s: float = 0.0
    token_s: float = 0.0
    aborted: list[dict] = field(default_factory=list)
    in_flight: int = 0  # paced requests being waited out now, and the most at once
    most_in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def counts(self) -> dict[str, int]:
        return {"in_flight": self.in_flight, "most_in_flight": self.most_in_flight}

    def _enter(self) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

    @property
    def paced(self) -> bool:
        return self.first_token_s > 0 or self.token_s > 0

    def whole(self, tokens: int) -> float:
        """How long a reply of ``tokens`` generated tokens takes, whole."""
        return self.first_token_s + self.token_s * max(tokens - 1, 0)

    def generated(self, seconds: float) -> int:
        """How many tokens a reply has generated ``seconds`` after it started (unbounded:
        the caller caps it at the reply's length)."""
        if seconds < self.first_token_s:
            return 0
        if self.token_s <= 0:
            return sys.maxsize
        return 1 + int((seconds - self.first_token_s) // self.token_s)

    def abort(self, request_id: str, arrived: float) -> None:
        with self._lock:
            self.aborted.append({"request_id": request_id, "after_s": time.monotonic() - arrived})


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _before(work: Awaitable[None], gone: asyncio.Future) -> bool:
    """Whether ``work`` finished before the client left (it is cancelled if not)."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    return task in done


async def _waited(pace: Pace, request: Request, flight: Flight) -> bool:
    """Hold while paused, then wait out the whole reply's time; False when the client left."""
    if not flight.held and not flight.frozen and flight.elapsed() >= pace.whole(flight.tokens):
        return True
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        if flight.held and not await _before(flight.admitted(), gone):
            return False
        if not pace.paced:
            return True
        pace._enter()
        try:
            return await _before(flight.run_until(pace.whole(flight.tokens)), gone)
        finally:
            pace.in_flight -= 1
    finally:
        gone.cancel()


async def whole(pace: Pace, request: Request, flight: Flight) -> Batches | None:
    """A whole reply's generations once its time has passed (cut ones cut), recorded; None
    when the client left first (kept as an abort)."""
    if not await _waited(pace, request, flight):
        pace.abort(flight.request_id, flight.arrived)
        flight.hang_up()
        return None
    return flight.settle()


async def _flight_lines(pace: Pace, flight: Flight, lines: Iterable[str]) -> AsyncIterator[str]:
    """The SSE lines of a held or paced stream: nothing before the request starts, then the
    first after ``first_token_s``, each later one after ``token_s`` (at once once cut); a
    client that leaves cancels the stream, which is kept as an abort."""
    entered = False
    try:
        await flight.admitted()
        if not pace.paced:
            flight.settle()
            for line in lines:
                yield line
            return
        pace._enter()
        entered = True
        delay = pace.first_token_s
        iterator = iter(lines)
        while True:
            await flight.sleep(delay)
            # The stream builds each line when it is due, so a cut is seen by the next one.
            line = next(iterator, None)
            if line is None:
                break
            if flight.cut or line == SSE_DONE:
                flight.settle()
            yield line
            delay = pace.token_s
    except (asyncio.CancelledError, GeneratorExit):
        pace.abort(flight.request_id, flight.arrived)
        flight.hang_up()
        raise
    finally:
        if entered:
            pace.in_flight -= 1


# nginx's status for a request whose client closed the connection first; nobody reads it.
CLIENT_CLOSED_REQUEST = 499


def streamed(pace: Pace, flight: Flight, lines: Iterable[str]) -> StreamingResponse:
    """An SSE response of ``lines``, held while paused and paced when the engine is."""
    if flight.held or pace.paced:
        body: Iterable[str] | AsyncIterator[str] = _flight_lines(pace, flight, lines)
    else:
        flight.settle()
        body = lines
    return StreamingResponse(body, media_type="text/event-stream")
