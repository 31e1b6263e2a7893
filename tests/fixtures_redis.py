"""Private redis-server processes for tests, each on a free port in its own temp dir.

The session server runs with AOF and ``appendfsync always`` and no RDB snapshots, bound to
127.0.0.1; ``REDIS_URL`` points the tests at another server instead (never the one on 6379
unless you say so). Extra servers (to kill, restart, or misconfigure) come from a factory
and are stopped by PID when the test ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.servers import free_port

DURABLE = {"appendonly": "yes", "appendfsync": "always", "save": ""}


class RedisServer:
    """One redis-server child process; restartable on the same port and data dir."""

    def __init__(self, data_dir: Path, **options: str | tuple[str, ...]) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.options = {**DURABLE, **options}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.data_dir), "--daemonize", "no", "--logfile", "server.log"]
        for name, value in self.options.items():  # a tuple value is several arguments
            args += [f"--{name}", *(value if isinstance(value, tuple) else (value,))]
        self.proc = subprocess.Popen(
            args, cwd=self.data_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = (self.data_dir / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                password = self.options.get("requirepass")
                with redis.Redis(port=self.port, password=password, socket_timeout=1) as client:
                    if client.ping():
                        return self
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} did not answer in {timeout}s")
            time.sleep(0.02)

    def kill9(self) -> None:
        """Crash it: no shutdown, no final fsync beyond what each write already did."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


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
