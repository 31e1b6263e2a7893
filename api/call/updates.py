"""The trainer's side of a weight update: pause the engine, hold calls, resume.

A trainer that updates the policy's weights calls ``POST /tokcap/pause`` before
(``{"mode": "abort"}`` or ``"wait"``) and ``POST /tokcap/resume`` after
(``{"version": "13"}``), with the front end's secret like ``PUT /tokcap/policy_version``.
Pause: the worker holds new calls instead of sending them (a streamed call is kept alive
meanwhile) and pauses its engine in that mode; in ``abort`` mode the engine cuts the calls
in flight, and each is continued once the engine is back (``api.call.resume``). Resume:
the new version is set (stored first, so every worker stamps what is sampled from now on
with it), the engine resumed, the held calls let go. The requests still out are settled
(``WeightUpdates.settle``) once the engine has paused, and again before it resumes.

``keep`` is refused: the engine would continue each call in flight on the new weights
without a word, and the front end could not tell which of its ids each version sampled.
An engine paused by someone else (the trainer talking to the engine directly) is handled
by the engine's own hold: a call it cut is continued at once, and the engine holds the
continuation until it resumes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from api.call.policy import version_problem
from api.edge.errors import plain_error
from api.edge.json_body import BodyError, parse_json_object
from api.engine.generation import UpstreamError

KEEP_REFUSED = (
    "mode keep cannot be served exactly: the engine continues each call in flight on the new "
    "weights and the front end cannot tell which ids each version sampled; pause with mode "
    "abort (cut calls are continued token-in on the new weights) or wait"
)
MODES = ("abort", "wait")
HELD_TOO_LONG = (
    "the engine was paused for a weight update and not resumed within {seconds} s "
    "(model_server.upstream_timeout_s): retry the request"
)


# Once the engine has paused, the requests sent before are waited for while their replies
# keep coming: a reply the engine finished (or cut) before the pause is on its way, but a
# busy host may take a while to deliver it, and each one sent again throws its sampling
# away (a real vLLM-CPU under load took over 0.5 s to answer one it had cut). Once none
# came for QUIET_S (or ten times the event loop's lag, if longer), or after SETTLE_S in all,
# those still out were held by the engine, or are too late to tell apart from one: they
# are sent again. Waiting costs only a longer pause, and only when a request is still out.
QUIET_S = 2.0
SETTLE_S = 10.0

T = TypeVar("T")


@dataclass(eq=False)
class Flight:
    """One engine request this worker sent, from its sending to its reply."""

    version: str | None  # the policy version in force when it was sent
    pauses: int  # the pauses this worker had made by then
    started: bool = False  # the engine showed it sampling (a relayed delta)
    released: bool = False  # sent again: it had not come back when the engine resumed
    task: asyncio.Future[Any] | None = None


class WeightUpdates:
    """One worker's side of the pauses it was asked for: whether calls are held now, and
    the engine requests it has out, so that each reply's version is known exactly.

    Nothing is sampled while the engine is paused, so a reply that came back before the
    resume was sampled on the weights it was sent under. A request still out when the
    engine is about to resume either finished before the pause (its reply still on the
    way) or was held by the engine (it reached the engine after the pause began, and will
    be sampled on the new weights). The two cannot be told apart from the front end, so
    ``settle`` waits a moment for the first kind and sends the rest again once the engine
    runs: every reply's version is then the one its request was sent under.
    """

    def __init__(self, held_seconds: Any = None, most_s: float = 600.0, resent: Any = None) -> None:
        self._running = asyncio.Event()
        self._running.set()
        self._held_seconds = held_seconds
        self._resent = resent
        self.most_s = most_s  # a pause no resume ends: held calls fail retryably after it
        self.settle_s = SETTLE_S
        self.pauses = 0
        self._flights: set[Flight] = set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def held(self) -> None:
        """Returns at once unless a pause is on; then once it ends."""
        if self._running.is_set():
            return
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._running.wait(), self.most_s)
        except TimeoutError:
            raise UpstreamError(503, HELD_TOO_LONG.format(seconds=self.most_s)) from None
        if self._held_seconds is not None:
            self._held_seconds.observe(time.perf_counter() - started)

    async def sent(
        self, request: Callable[[Flight], Awaitable[T]], version: Callable[[], str | None]
    ) -> tuple[T, Flight]:
        """``request``'s reply once no pause holds it, and its flight (the version it was
        sent under); sent again if a resume released it."""
        while True:
            await self.held()
            flight = Flight(version(), self.pauses)
            flight.task = asyncio.ensure_future(request(flight))
            self._flights.add(flight)
            try:
                return await flight.task, flight
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not flight.released or (current is not None and current.cancelling()):
                    raise
            finally:
                self._flights.discard(flight)

    def pause(self) -> None:
        self.pauses += 1
        self._running.clear()

    async def settle(self) -> int:
        """Before the engine resumes: wait for the requests out that showed no sampling
        while their replies keep coming (at most ``settle_s``), then release those still
        out (sent again after the resume).
        How many were released."""
        waiting = [f for f in self._flights if f.task and not f.task.done() and not f.started]
        await _while_coming([f.task for f in waiting if f.task], self.settle_s)
        released = [f for f in waiting if f.task and not f.task.done()]
        for flight in released:
            flight.released = True
            assert flight.task is not None
            flight.task.cancel()
        if released:  # their connections closed before the resume, so the engine drops them
            await asyncio.wait([f.task for f in released if f.task], timeout=self.settle_s)
        if released and self._resent is not None:
            self._resent.inc(len(released))
        return len(released)

    def resume(self) -> None:
        self._running.set()


async def _while_coming(tasks: list[asyncio.Future[Any]], most_s: float) -> None:
    """Wait for ``tasks`` while they keep finishing: until all are done, none finished in a
    quiet window, or ``most_s`` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + most_s
    pending = {task for task in tasks if not task.done()}
    while pending and loop.time() < deadline:
        before = loop.time()
        await asyncio.sleep(0)
        quiet = max(QUIET_S, 10 * (loop.time() - before))
        window = min(quiet, deadline - loop.time())
        done, pending = await asyncio.wait(pending, timeout=max(window, 0))
        if not done:
            return


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return parse_json_object(raw) if raw.strip() else {}


async def pause_route(request: Request) -> Response:
    """``POST /tokcap/pause``: hold new calls and pause the engine (``mode``: abort, wait)."""
    if "tokcap_rollout_id" in request.scope:  # a rollout's path: never the trainer's route
        return plain_error(404, "not found")
    front = request.app.state.front_end
    try:
        mode = (await _body(request)).get("mode", request.query_params.get("mode", "abort"))
    except BodyError as exc:
        return plain_error(400, str(exc))
    if mode == "keep":
        return plain_error(400, KEEP_REFUSED)
    if mode not in MODES:
        return plain_error(400, f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    front.updates.pause()
    try:
        await front.engines.pause(mode)
    except (UpstreamError, ValueError) as exc:
        front.updates.resume()  # the engine runs on: so do the calls
        message = exc.message if isinstance(exc, UpstreamError) else str(exc)
        return plain_error(502 if isinstance(exc, UpstreamError) else 400, message)
    front.metrics.pauses.labels(mode=mode).inc()
    # Settled now, not at the resume: a request the engine held is dropped when its
    # connection closes, and the weight update gives the engine time to notice before it
    # resumes (else it may start the request first, and sample what is thrown away).
    await front.updates.settle()
    return JSONResponse({"status": "paused", "mode": mode})


async def resume_route(request: Request) -> Response:
    """``POST /tokcap/resume``: set the new version (if given), resume the engine, let the
    held calls go."""
    if "tokcap_rollout_id" in request.scope:
        return plain_error(404, "not found")
    front = request.app.state.front_end
    try:
        body = await _body(request)
    except BodyError as exc:
        return plain_error(400, str(exc))
    if "version" in body:
        problem = version_problem(body)
        if problem is not None:
            return plain_error(400, problem)
        try:
            await front.policy.set(str(body["version"]))
        except Exception as exc:
            return plain_error(503, f"the store did not take the version ({type(exc).__name__})")
    await front.updates.settle()
    try:
        await front.engines.resume()
    except UpstreamError as exc:
        return plain_error(502, exc.message)
    finally:
        front.updates.resume()
    return JSONResponse({"status": "resumed", "version": front.policy.current})
