"""A ``tokcap serve`` worker moves what its start-up built out of the garbage collector's
reach (``gc.freeze``), so a full collection under load walks only the calls in flight, and
collects fully less often; an app embedded in another process leaves that process's
collector as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from api.app import FULL_COLLECTION_EVERY

STARTED = """
import asyncio, gc, sys
from api.app import create_app
from tests.support.frontend import file_store_settings

async def main() -> None:
    settings = file_store_settings("http://127.0.0.1:9", sys.argv[1])
    app = create_app(settings, own_process=sys.argv[2] == "own")
    async with app.router.lifespan_context(app):
        print(gc.get_threshold()[2], gc.get_freeze_count())

asyncio.run(main())
"""


@pytest.mark.parametrize(("process", "frozen"), [("own", True), ("embedded", False)])
def test_a_worker_freezes_what_its_start_up_built(
    tmp_path: Path, process: str, frozen: bool
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", STARTED, str(tmp_path / "captures"), process],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    full_every, count = map(int, done.stdout.split()[-2:])
    assert (count > 10_000) if frozen else count == 0
    assert full_every == (FULL_COLLECTION_EVERY if frozen else 10)  # else Python's default
