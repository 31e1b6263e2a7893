"""The routes that say how a worker stands: the base URL, liveness, readiness, metrics.

None of them is a model call or needs a key (``api.edge.keys.OPEN_PATHS``). ``/ready``
asks the sink and the upstream at once, each within ``READY_TIMEOUT_S``, so a load
balancer's probe gets its answer in about that time even when both are down.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from api.edge.metrics import FrontEndMetrics
from api.engine.client import UpstreamClient
from api.engine.generation import UpstreamError
from api.engine.pool import EnginePool
from api.state import front_end
from capture.protocols import TokenSink

# How long /ready waits for the sink and for the upstream; a probe must answer quickly.
READY_TIMEOUT_S = 2.0
# How long a /metrics scrape waits for the Redis memory reading before it answers without.
SCRAPE_MEMORY_TIMEOUT_S = 0.5


async def base_path() -> dict[str, str]:
    """A base URL answers (harnesses probe it with HEAD before the first call)."""
    return {"status": "ok", "service": "tokcap"}


async def health() -> dict[str, str]:
    """Liveness: the process answers. Whether it can serve a call is ``/ready``'s question."""
    return {"status": "ok"}


async def _sink_problem(sink: TokenSink | None) -> str | None:
    """Why the sink cannot take an entry now, or None (also when there is no sink).

    Redis: a PING on the store's own client (its pool, its password); the file store: its
    directory is writable. The message names the server as host:port, never credentials.
    """
    if sink is None:
        return None
    ping = getattr(sink, "ping", None)
    if callable(ping):
        where = getattr(sink, "where", "redis")
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await ping()
        except Exception as exc:  # any failure means not ready; the type says which
            return f"{where} did not answer PING: {type(exc).__name__}"
        return None
    directory = getattr(sink, "dir", None)
    if directory is not None and not os.access(directory, os.W_OK | os.X_OK):
        return f"the capture directory {directory} is not writable"
    return None


async def _sink_memory(
    sink: TokenSink | None, metrics: FrontEndMetrics, timeout_s: float = READY_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Memory used against ``maxmemory`` on each server of a Redis sink (none for others),
    also set on the metrics' gauges; a server that does not answer is ``/ready``'s PING
    problem, so it is left out here."""
    memory = getattr(sink, "memory", None)
    if not callable(memory):
        return []
    try:
        async with asyncio.timeout(timeout_s):
            readouts = await memory()
    except Exception:  # not ready is said by the PING; the headroom is only informative
        return []
    metrics.record_memory(readouts)
    return [readout.as_dict() for readout in readouts]


async def _engines_problem(pool: EnginePool) -> tuple[str | None, list[dict[str, Any]]]:
    """Why no engine of the pool can serve a call now, or None; and each engine's state
    with its own problem, if any."""
    report = pool.report()
    problems = await asyncio.gather(*(_upstream_problem(engine.client) for engine in pool.engines))
    for row, problem in zip(report, problems, strict=True):
        if problem is not None:
            row["problem"] = problem
    serving = [p for row, p in zip(report, problems, strict=True) if row["state"] != "draining"]
    if any(problem is None for problem in serving):
        return None, report
    return (serving[0] if len(serving) == 1 else "no engine of the pool answers"), report


async def _upstream_problem(upstream: UpstreamClient) -> str | None:
    """Why the upstream cannot serve a call now (GET /v1/models), or None."""
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await upstream.models()
    except TimeoutError:
        return f"upstream {upstream.where} did not answer within {READY_TIMEOUT_S} s"
    except UpstreamError:
        return f"upstream {upstream.where} did not list its models"
    return None


async def ready(request: Request) -> Response:
    """Readiness: 200 when the sink and the upstream answer, else 503 naming what does not.

    All are asked at once, each within READY_TIMEOUT_S, so a load balancer's probe gets its
    answer in about that time even when both are down. A Redis sink's memory headroom rides
    along (``redis_memory``): a server at its ``maxmemory`` refuses the next writes.
    """
    front = front_end(request)
    sink = front.slot.sink
    sink_problem, (upstream_problem, engines), memory = await asyncio.gather(
        _sink_problem(sink), _engines_problem(front.engines), _sink_memory(sink, front.metrics)
    )
    problems = {
        name: problem
        for name, problem in (("sink", sink_problem), ("upstream", upstream_problem))
        if problem is not None
    }
    extra: dict[str, Any] = {"engines": engines}
    if memory:
        extra["redis_memory"] = memory
    if problems:
        return JSONResponse({"status": "not ready", "problems": problems, **extra}, status_code=503)
    return JSONResponse({"status": "ready", **extra})


async def metrics(request: Request) -> Response:
    front = front_end(request)
    # The gauges, read now; a Redis that does not answer at once leaves the last reading.
    await _sink_memory(front.slot.sink, front.metrics, SCRAPE_MEMORY_TIMEOUT_S)
    data, content_type = front.metrics.exposition()
    return Response(data, media_type=content_type)
