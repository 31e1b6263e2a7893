"""Shared fixtures live in plugin modules, one per concern, so parts can grow independently;
``tests.support.parallel`` splits the suite between pytest-xdist's processes."""

pytest_plugins = [
    "tests.support.fixtures_redis",
    "tests.support.fixtures_cluster",
    "tests.support.fixtures_stores",
    "tests.support.parallel",
]
