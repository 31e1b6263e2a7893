"""Shared fixtures live in plugin modules, one per concern, so parts can grow independently."""

pytest_plugins = ["tests.fixtures_redis", "tests.fixtures_stores"]
