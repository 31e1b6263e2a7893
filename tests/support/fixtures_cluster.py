"""A private Redis Cluster for tests: three masters with one replica each, on loopback.

Started once per session (``redis_cluster``) in a temp dir, on free ports, and stopped by
PID at the end, also when a test fails; a test that kills nodes asks the factory for a
cluster of its own. A machine without redis-server or redis-cli skips these tests.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tokcap_devtools.redis_cluster import LocalCluster
from tokcap_devtools.redis_server import RedisServerUnavailable


def _start(data_dir: Path) -> LocalCluster:
    try:
        return LocalCluster(data_dir).start()
    except RedisServerUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """The session's cluster; tests keep to their own key prefix on it."""
    with tempfile.TemporaryDirectory(prefix="tokcap-cluster-") as tmp:
        cluster = _start(Path(tmp))
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def redis_cluster_factory(tmp_path: Path) -> Iterator[Callable[[], LocalCluster]]:
    """Start a cluster of the test's own (to kill a master of); stopped at test end."""
    clusters: list[LocalCluster] = []

    def factory() -> LocalCluster:
        clusters.append(_start(tmp_path / f"cluster-{len(clusters)}"))
        return clusters[-1]

    yield factory
    for cluster in clusters:
        cluster.stop()
