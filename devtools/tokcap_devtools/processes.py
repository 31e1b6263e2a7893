"""Child processes of the product's own commands (the demo, test drivers): start, wait, stop.

A service is started as ``python -m <module>``, answers on 127.0.0.1, and is stopped by the
PID it was started with: SIGTERM first, SIGKILL only if it does not go.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (uvicorn's workers, an engine's scheduler), from /proc."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):
                pending += [int(child) for child in (task / "children").read_text().split()]
    return found


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers (any status), or fail with what is known."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM the process we started, SIGKILL if it lingers; returns its exit code."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


class Service:
    """One ``python -m module`` child with its output in a log file (``python``: another
    interpreter, such as a venv of the engine's own)."""

    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [python, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, url: str, timeout: float = 60.0) -> None:
        try:
            wait_http(url, timeout=timeout, proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{self.name} did not start: {exc}\n{self.log_tail()}") from None

    def stop(self) -> int:
        code = stop_process(self.proc)
        self._log.close()
        return code

    def log_tail(self, limit: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-limit:]
