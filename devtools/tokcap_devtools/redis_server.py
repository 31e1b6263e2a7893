"""A private redis-server child process: durable (AOF, ``appendfsync always``), on 127.0.0.1.

The demo and the tests start their own server on a free port in a directory of their own,
so they never touch, depend on or flush a Redis someone else runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tokcap_devtools.processes import free_port, stop_process

DURABLE = {"appendonly": "yes", "appendfsync": "always", "save": ""}


class RedisServerUnavailable(RuntimeError):
    """redis-server is not installed on this machine."""


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """One redis-server child process; restartable on the same port and data dir."""

    def __init__(self, data_dir: Path, **options: str | tuple[str, ...]) -> None:
        self.data_dir = Path(data_dir)
        self.port = free_port()
        self.options = {**DURABLE, **options}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        binary = redis_server_binary()
        if binary is None:
            raise RedisServerUnavailable(
                "redis-server is not installed (apt-get install -y redis-server)"
            )
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--logfile",
            "server.log",
        ]
        for name, value in self.options.items():  # a tuple value is several arguments
            args += [f"--{name}", *(value if isinstance(value, tuple) else (value,))]
        self.proc = subprocess.Popen(
            args,
            cwd=self.data_dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
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
        if self.proc is not None:
            stop_process(self.proc)
