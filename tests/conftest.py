"""Shared fixtures live in plugin modules, one per concern, so parts can grow independently.

The suite runs in two processes (pytest-xdist, ``-n 2 --dist loadgroup``: the README's
command). Each module is one unit of work, so its module-scoped servers start once; the
real-engine tier is one unit (its engines are session fixtures, started once per process,
and one process installs them), and it goes first: it is the longest, and the other process
runs the rest of the suite beside it.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "tests.support.fixtures_redis",
    "tests.support.fixtures_cluster",
    "tests.support.fixtures_stores",
]

REAL_ENGINES = "tests/real_engines/"


def _unit_of_work(item: pytest.Item) -> str:
    """The xdist group an item runs in: the real-engine tier's, else its module's."""
    module = item.nodeid.split("::", 1)[0]
    return "real_engines" if module.startswith(REAL_ENGINES) else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit_of_work(item)))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike: the tier first
        items.sort(key=lambda item: not item.nodeid.startswith(REAL_ENGINES))
