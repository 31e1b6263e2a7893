"""Fixtures of the end-to-end modules: the CLI, the namespace, Redis, a worker, and the
scripted engine with its ground truth that the fault tests judge by.

Redis and the worker are module-scoped, so every module gets a private redis-server and
the worker on it is that module's only consumer of the jobs stream: a module that needs
another delivery overrides ``worker_delivery`` without racing another module's worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.claude_code import ClaudeCliUnavailable, ensure_claude_cli, netns_problem
from tests.support.fault_loops import Engine, write_script
from tests.support.fixtures_redis import RedisServer
from tests.support.frontend import engine_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def claude_cli() -> Path:
    try:
        return ensure_claude_cli()
    except ClaudeCliUnavailable as exc:
        pytest.skip(f"the Claude Code CLI could not be installed with npm: {exc}")


@pytest.fixture(scope="module")
def netns() -> None:
    """The CLI must run where nothing can leave the machine: fail, never skip, without it."""
    problem = netns_problem()
    if problem:
        pytest.fail(f"cannot make a loopback-only network namespace: {problem}")


@pytest.fixture(scope="module")
def redis_socket() -> Iterator[str]:
    """A private durable redis-server; its unix socket crosses the network namespace."""
    with tempfile.TemporaryDirectory(prefix="tkcc-") as tmp:  # short: sun_path is 108 bytes
        socket_path = Path(tmp) / "redis.sock"
        server = RedisServer(Path(tmp), unixsocket=str(socket_path), unixsocketperm="700")
        server.start()
        try:
            yield f"unix://{socket_path}?db=0"
        finally:
            server.stop()


@pytest.fixture(scope="module")
def worker_delivery() -> str:
    """What the module's worker delivers (``--delivery``); a module overrides it."""
    return "chain"


@pytest.fixture(scope="module")
def worker(redis_socket: str, worker_delivery: str) -> Iterator[subprocess.Popen]:
    """One real ``tokcap worker`` process on the job stream, stopped by PID."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokcap.commands.worker",
                "--url",
                redis_socket,
                "--concurrency",
                "2",
                "--block-ms",
                "200",
                "--delivery",
                worker_delivery,
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """The fault tests' engine: the scripted tool-loop policy, logging its ground truth."""
    script = write_script(tmp_path / "script.yaml")
    truth = tmp_path / "ground_truth.jsonl"
    with engine_server(script_path=script, ground_truth_path=str(truth)) as url:
        yield Engine(url, truth)
