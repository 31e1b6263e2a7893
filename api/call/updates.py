"""The trainer's side of a weight update: pause the engine, hold calls, resume.

A trainer that updates the policy's weights calls ``POST /tokcap/pause`` before
(``{"mode": "abort"}`` or ``"wait"``) and ``POST /tokcap/resume`` after
(``{"version": "13"}``), with the front end's secret like ``PUT /tokcap/policy_version``.
Pause: the worker holds new calls instead of sending them (a streamed call is kept alive
meanwhile) and pauses its engine in that mode; in ``abort`` mode the engine cuts the calls
in flight, and each is continued once the engine is back (``api.call.resume``). Resume:
the new version is set (stored first, so every worker stamps what is sampled from now on
with it), the engine resumed, the held calls let go.

``keep`` is refused: the engine would continue each call in flight on the new weights
without a word, and the front end could not tell which of its ids each version sampled.
An engine paused by someone else (the trainer talking to the engine directly) is handled
by the engine's own hold: a call it cut is continued at once, and the engine holds the
continuation until it resumes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

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


class WeightUpdates:
    """One worker's view of a pause it was asked for: whether calls are held now."""

    def __init__(self, held_seconds: Any = None, most_s: float = 600.0) -> None:
        self._running = asyncio.Event()
        self._running.set()
        self._held_seconds = held_seconds
        self.most_s = most_s  # a pause no resume ends: held calls fail retryably after it
        # Resumes this worker made: a call in flight across one was sampled after it.
        self.resumes = 0

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

    def pause(self) -> None:
        self._running.clear()

    def resuming(self) -> None:
        """The engine is about to run on new weights: a call that comes back from now on
        without being cut was held through the pause, and sampled after it."""
        self.resumes += 1

    def resume(self) -> None:
        self._running.set()


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
        await front.upstream.pause(mode)
    except (UpstreamError, ValueError) as exc:
        front.updates.resume()  # the engine runs on: so do the calls
        message = exc.message if isinstance(exc, UpstreamError) else str(exc)
        return plain_error(502 if isinstance(exc, UpstreamError) else 400, message)
    front.metrics.pauses.labels(mode=mode).inc()
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
    front.updates.resuming()
    try:
        await front.upstream.resume()
    except UpstreamError as exc:
        return plain_error(502, exc.message)
    finally:
        front.updates.resume()
    return JSONResponse({"status": "resumed", "version": front.policy.current})
