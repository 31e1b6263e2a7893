"""Real servers for tests: uvicorn apps on free 127.0.0.1 ports, and child processes.

Every server started here is stopped by the same context manager, by the handle or PID it
started, so a failing test never leaves a listener behind.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from tokcap_devtools.processes import free_port, stop_process, wait_http

__all__ = ["free_port", "wait_http", "serve_app", "run_process"]


@contextlib.contextmanager
def serve_app(
    app: Any, *, ready_path: str = "/health", port: int | None = None, **config: Any
) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a thread (on ``port``, else a free one); yields its
    base URL."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + ready_path)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def run_process(
    args: list[str],
    *,
    ready_url: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Iterator[subprocess.Popen]:
    """Start a child process (``python -m ...`` style args allowed) and stop it by PID."""
    if args and args[0] == "python":
        args = [sys.executable, *args[1:]]
    # Output goes to a file, never an unread pipe that could fill and block the child.
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(
            args,
            env={**os.environ, **(env or {})},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if ready_url:
                try:
                    wait_http(ready_url, timeout=timeout, proc=proc)
                except (RuntimeError, TimeoutError) as exc:
                    output.seek(0)
                    tail = output.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"{exc}\n{tail}") from None
            yield proc
        finally:
            stop_process(proc)
