"""How long a reply takes: the engine paced like a real one under load, and its aborts.

A real engine answers once it has queued and prefilled the prompt (the time to the first
token), then one token at a time. ``first_token_s`` and ``token_s`` (``--first-token-s``,
``--token-s``) make the tokcap engine take as long: a whole reply waits for both, a stream
sends its first chunk after the first and each later one after the second. A client that
disconnects meanwhile aborts the request, as vLLM aborts one whose client left (its serving
code listens for the disconnect); each abort is kept with the time since the request
arrived, served at ``GET /tokcap/aborted`` beside the ground truth, so tests can check
that a front end cancels what its harness abandoned; ``GET /tokcap/pace`` says how many
requests it is waiting out now and the most at once (how many calls a front end let through).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse


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

    def abort(self, request_id: str, arrived: float) -> None:
        with self._lock:
            self.aborted.append({"request_id": request_id, "after_s": time.monotonic() - arrived})


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_whole(
    pace: Pace, request: Request, tokens: int, request_id: str, arrived: float
) -> bool:
    """Wait out a whole reply's time; False (and an abort kept) when the client left."""
    seconds = pace.whole(tokens) - (time.monotonic() - arrived)
    if not pace.paced or seconds <= 0:
        return True
    gone = asyncio.ensure_future(_disconnected(request))
    pace._enter()
    try:
        await asyncio.wait_for(asyncio.shield(gone), seconds)
    except TimeoutError:
        return True
    finally:
        pace.in_flight -= 1
        gone.cancel()
    pace.abort(request_id, arrived)
    return False


async def paced_lines(
    pace: Pace, lines: Iterable[str], request_id: str, arrived: float
) -> AsyncIterator[str]:
    """The SSE lines of a stream, the first after ``first_token_s``, each later one after
    ``token_s``; a client that leaves cancels the stream, which is kept as an abort."""
    delay = pace.first_token_s
    pace._enter()
    try:
        for line in lines:
            if delay > 0:
                await asyncio.sleep(delay)
            delay = pace.token_s
            yield line
    except (asyncio.CancelledError, GeneratorExit):
        pace.abort(request_id, arrived)
        raise
    finally:
        pace.in_flight -= 1


# nginx's status for a request whose client closed the connection first; nobody reads it.
CLIENT_CLOSED_REQUEST = 499


def longest(generations: Iterable) -> int:
    """The most tokens any of a request's generations holds: how long the reply takes."""
    return max((len(g.token_ids) for g in generations), default=0)


def streamed(
    pace: Pace, lines: Iterable[str], request_id: str, arrived: float
) -> StreamingResponse:
    """An SSE response of ``lines``, paced when the engine is."""
    body = paced_lines(pace, lines, request_id, arrived) if pace.paced else lines
    return StreamingResponse(body, media_type="text/event-stream")
