"""The one loop that rides out an outage: try, and after an error that says "not now",
pause and try again until the caller stops.

The capture context (``capture.context.retry_until``), the Redis store
(``transports.redis.reach``) and the rebuild worker (``transports.rebuild.worker``) all retry
through it, each with its own answers: which errors are an outage (``is_outage``), how long
to pause after the n-th failure in a row, or None to stop (``pause_after``), and what to do
between tries (``between``). Any other error is an answer, not an outage: it is raised at
once. When the caller stops, ``OutageOutlasted`` carries the last error and the count of
failed tries, for the caller to report in its own words. It lives in ``capture`` because
``capture`` may not import ``transports``; the other way round is allowed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
# Pauses stop doubling here: far past any cap, and the float stays finite however long
# an outage lasts.
_MAX_DOUBLINGS = 30


@dataclass(frozen=True)
class Backoff:
    """Pauses that start at ``first_s`` and double after each failure, up to ``most_s``."""

    first_s: float
    most_s: float

    def after(self, failures: int) -> float:
        """The pause after ``failures`` failures in a row (after the first: ``first_s``)."""
        return min(self.first_s * 2 ** min(failures - 1, _MAX_DOUBLINGS), self.most_s)


class OutageOutlasted(Exception):
    """The caller stopped retrying: ``last`` is the outage's last error, ``failures`` how
    many tries failed."""

    def __init__(self, last: Exception, failures: int) -> None:
        super().__init__(f"gave up after {failures} failed tries: {last}")
        self.last = last
        self.failures = failures


async def retry_through_outage(
    attempt: Callable[[], Awaitable[T]],
    *,
    is_outage: Callable[[Exception], bool],
    pause_after: Callable[[int], float | None],
    on_outage: Callable[[Exception, float], None] | None = None,
    between: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """What ``attempt()`` returns once it succeeds; an error that is not an outage raises.

    After the n-th failure in a row, ``pause_after(n)`` is the pause before the next try, or
    None to stop: OutageOutlasted is then raised from the last error. ``on_outage`` hears of
    each failure that will be tried again, with its pause (to log it); ``between`` runs
    after each pause, before the next try (a cluster reads its slot map again there).
    """
    failures = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if not is_outage(exc):
                raise
            failures += 1
            pause_s = pause_after(failures)
            if pause_s is None:
                raise OutageOutlasted(exc, failures) from exc
            last = exc
        if on_outage is not None:
            on_outage(last, pause_s)
        await asyncio.sleep(pause_s)
        if between is not None:
            await between()
