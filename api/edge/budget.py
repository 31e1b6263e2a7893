"""Bytes of request bodies in flight in one worker, granted first come first served.

A call whose body does not fit waits in line instead of being refused: under a burst every
call is served in the order it came, and none is starved by smaller ones slipping past
(a waiting body blocks those behind it, as a queue at a counter does). A call that waited
longer than its caller allows leaves the line, and the front end answers it 503.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    size: int
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class ByteBudget:
    """``limit`` bytes, taken and given back by the requests that read bodies."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._line: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Calls in line for room."""
        return len(self._line)

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes fit now (one body always fits an empty budget)."""
        return self.used == 0 or self.used + size <= self.limit

    def grow(self, size: int) -> bool:
        """Take ``size`` more bytes at once if they fit and nobody waits; False if not."""
        if self._line or not self.fits(size):
            return False
        self.used += size
        return True

    async def take(self, size: int, wait_s: float) -> bool:
        """Take ``size`` bytes, waiting in line for at most ``wait_s``; False if it timed out."""
        if self.grow(size):
            return True
        waiter = _Waiter(size)
        self._line.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), wait_s)
            return True
        except TimeoutError:
            return self._leave(waiter)
        except asyncio.CancelledError:
            if not self._leave(waiter):
                raise
            self.give(size)  # granted as it was cancelled: hand the room on
            raise

    def give(self, size: int) -> None:
        """Hand ``size`` bytes back, and let in whoever now fits at the head of the line."""
        self.used -= size
        while self._line and self.fits(self._line[0].size):
            waiter = self._line.popleft()
            self.used += waiter.size
            waiter.granted.set_result(None)

    def _leave(self, waiter: _Waiter) -> bool:
        """Leave the line; True if the room was granted meanwhile (it is then taken)."""
        if waiter.granted.done():
            return True
        self._line.remove(waiter)
        waiter.granted.cancel()
        self.give(0)  # the head may have changed: let in whoever fits now
        return False
