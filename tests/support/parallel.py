"""How the suite is split between the processes of pytest-xdist (``-n 2``: the README's
command).

Each module (or test class) is one unit of work, so its module-scoped servers start once.
The real-engine tier is one unit: its engines are session fixtures, started once per
process, and one process installs them. It goes first, as the longest unit, so the other
process runs the rest of the suite beside it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

REAL_ENGINES = "tests/real_engines/"


def in_tier(nodeid: str) -> bool:
    """Whether a test belongs to the real-engine tier."""
    return nodeid.startswith(REAL_ENGINES)


class UnitsOfWork(LoadScopeScheduling):
    """xdist's per-module scheduling, with the real-engine tier as a single unit."""

    def _split_scope(self, nodeid: str) -> str:
        return "real_engines" if in_tier(nodeid) else super()._split_scope(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> UnitsOfWork:
    return UnitsOfWork(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each xdist worker sorts alike, the tier first; the units go out in this order
    (``--no-loadscope-reorder``). A run in one process keeps pytest's order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not in_tier(item.nodeid))
