"""A worker's garbage collector runs on a clock, not every 700 allocations.

While its engine samples (seconds to minutes), a call holds about 150 objects the collector
tracks: coroutines, tasks, the engine request. Python's collector, counting allocations,
walks each of them twice before the call ends (young, then middle): about a tenth of the
front end's CPU at 1,000 loops (``bench_serving``). Almost none die in cycles; reference
counting frees them when the call ends. So a worker that is a process of its own moves what
its start-up built out of the collector's reach (``gc.freeze``), turns automatic collection
off, and collects fully every ``COLLECT_EVERY_S``, or sooner once ``MOST_UNCOLLECTED``
tracked objects were made since the last collection. Each collection walks the calls in
flight once (about 200 ms at 1,000 loops, the stall a full collection always was), and
cyclic garbage waits for it at most ``COLLECT_EVERY_S``.

An app embedded in another process leaves that process's collector as it is.
"""

from __future__ import annotations

import asyncio
import gc
import time

# Seconds between full collections: cyclic garbage lives at most this long. Each walks the
# calls in flight once, where Python's scheme walks every call's objects twice, so the clock
# costs less for every call shorter than twice this (at 1,000 loops: about 8 against 40 ms
# of CPU a second); a longer call is walked more often, at a cost that stays small.
COLLECT_EVERY_S = 30.0
# Tracked objects made (and still alive or in cycles) since the last collection that make
# the next one due at once: a burst cannot grow without bound between two ticks.
MOST_UNCOLLECTED = 1_000_000
# How often the clock looks at the count.
LOOK_EVERY_S = 1.0


def stop_collecting_on_allocations() -> None:
    """Freeze what start-up built and stop collecting on allocations; ``collect_on_a_clock``
    must then run for the worker's life."""
    gc.collect()
    gc.freeze()
    gc.disable()


async def collect_on_a_clock(
    every_s: float = COLLECT_EVERY_S,
    most: int = MOST_UNCOLLECTED,
    look_s: float = LOOK_EVERY_S,
) -> None:
    """Collect fully every ``every_s``, or at the first look after ``most`` tracked objects
    were made since the last collection. Runs until cancelled."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(look_s)
        if gc.get_count()[0] > most or time.monotonic() - last >= every_s:
            gc.collect()
            last = time.monotonic()
