"""A ``tokcap serve`` worker moves what its start-up built out of the garbage collector's
reach (``gc.freeze``) and collects on a clock instead of on allocations
(``api.collector``); an app embedded in another process leaves that process's collector as
it was. The clock collects cyclic garbage on time, and sooner after a burst."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.collector import collect_on_a_clock

STARTED = """
import asyncio, gc, sys
from api.app import create_app
from tests.support.frontend import file_store_settings

async def main() -> None:
    settings = file_store_settings("http://127.0.0.1:9", sys.argv[1])
    app = create_app(settings, own_process=sys.argv[2] == "own")
    async with app.router.lifespan_context(app):
        print(int(gc.isenabled()), gc.get_threshold()[0], gc.get_freeze_count())

asyncio.run(main())
"""


@pytest.mark.parametrize(("process", "own"), [("own", True), ("embedded", False)])
def test_a_worker_freezes_its_start_up_and_stops_collecting_on_allocations(
    tmp_path: Path, process: str, own: bool
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", STARTED, str(tmp_path / "captures"), process],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    enabled, young, count = map(int, done.stdout.split()[-3:])
    assert (count > 10_000) if own else count == 0
    assert enabled == (0 if own else 1)  # automatic collection off in a worker of its own
    assert young == 700  # Python's default threshold, untouched either way


class Cycle:
    """An object that refers to itself: only a collection frees it."""

    def __init__(self) -> None:
        self.me = self


def _garbage_cycle() -> weakref.ref[Cycle]:
    return weakref.ref(Cycle())


@pytest.fixture
def collection_off() -> Iterator[None]:
    """Automatic collection off for the test, as in a worker; on again after it."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _collected_within(cycle: weakref.ref[Cycle], **clock: float) -> bool:
    clock_task = asyncio.create_task(collect_on_a_clock(look_s=0.01, **clock))
    try:
        for _ in range(100):
            await asyncio.sleep(0.01)
            if cycle() is None:
                return True
        return False
    finally:
        clock_task.cancel()


@pytest.mark.usefixtures("collection_off")
async def test_the_clock_collects_cyclic_garbage_when_its_time_comes() -> None:
    cycle = _garbage_cycle()
    assert cycle() is not None  # nothing collects it with collection off
    assert await _collected_within(cycle, every_s=0.05, most=10**12)


@pytest.mark.usefixtures("collection_off")
async def test_the_clock_collects_at_once_after_a_burst_of_objects() -> None:
    cycle = _garbage_cycle()
    burst = [[] for _ in range(2_000)]  # tracked objects made since the last collection
    assert await _collected_within(cycle, every_s=3600, most=1_000)
    del burst


@pytest.mark.usefixtures("collection_off")
async def test_the_clock_waits_for_its_time_and_its_count() -> None:
    gc.collect()  # the count starts from nothing
    cycle = _garbage_cycle()
    assert not await _collected_within(cycle, every_s=3600, most=10**12)
    assert cycle() is not None
