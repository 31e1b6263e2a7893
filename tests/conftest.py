"""Shared fixtures live in plugin modules, one per concern, so parts can grow independently."""

pytest_plugins = [
    "tests.support.fixtures_redis",
    "tests.support.fixtures_cluster",
    "tests.support.fixtures_stores",
]
