"""Private redis-server processes for tests, each on a free port in its own temp dir.

The session server runs with AOF and ``appendfsync always`` and no RDB snapshots, bound to
127.0.0.1; ``REDIS_URL`` points the tests at another server instead (never the one on 6379
unless you say so). Extra servers (to kill, restart, or misconfigure) come from a factory
and are stopped by PID when the test ends. ``redis_client`` is a plain client of the
session server.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tokcap_devtools.redis_server import DURABLE, RedisServerUnavailable
from tokcap_devtools.redis_server import RedisServer as _RedisServer

__all__ = ["DURABLE", "RedisServer"]


class RedisServer(_RedisServer):
    """The product's private redis-server; a machine without redis-server skips the test."""

    def start(self, timeout: float = 20.0) -> RedisServer:
        try:
            super().start(timeout)
        except RedisServerUnavailable as exc:
            pytest.skip(str(exc))
        return self


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the Redis every store test uses: private, unless REDIS_URL says otherwise."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with tempfile.TemporaryDirectory(prefix="tokcap-redis-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of its own, so tests sharing one server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client of the test server, for looking at streams and keys; closed after."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator:
    """Start extra private servers: ``factory(appendonly="no")``; all stopped at test end.

    Options are redis-server flags; a tuple gives several values, as in
    ``factory(**{"rename-command": ("CONFIG", "")})``.
    """
    servers: list[RedisServer] = []

    def factory(**options: str | tuple[str, ...]) -> RedisServer:
        data_dir = tmp_path / f"redis-{len(servers)}"
        data_dir.mkdir()
        server = RedisServer(data_dir, **options)
        servers.append(server)
        return server.start()

    yield factory
    for server in reversed(servers):  # replicas before their primary
        server.stop()
