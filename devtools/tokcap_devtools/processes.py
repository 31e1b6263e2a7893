"""Child processes of the product's own commands (the demo, test drivers): start, wait, stop.

A service is started as ``python -m <module>``, answers on 127.0.0.1, and is stopped by the
PID it was started with: SIGTERM first, SIGKILL only if it does not go.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# Where test servers listen: below the kernel's ephemeral range, from which every connect()
# and bind(0) on the machine gets a port. A server port chosen inside that range is free only
# until the kernel hands it to someone else: an engine that loads for a minute before it binds
# found its port already taken (by a listener that accepted and never answered, as torch's
# gloo listeners on kernel-chosen ports do, or by a loopback connection that opened to
# itself) and exited. Also below 22000, where SGLang picks its own torch.distributed port.
PORT_FLOOR, PORT_CEILING = 10000, 22000


def ephemeral_low() -> int:
    """The first port the kernel hands to client connections (32768 unless configured)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _worker_share() -> tuple[int, int]:
    """This test worker's share of the ports (index, count) when pytest-xdist runs the tests
    in several processes (its ``PYTEST_XDIST_WORKER`` is ``gw<index>``); (0, 1) otherwise."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    with contextlib.suppress(ValueError):
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if name.startswith("gw") and count > 1:
            return int(name[2:]) % count, count
    return 0, 1


@functools.cache
def _port_order(pid: int) -> tuple[int, Iterator[int]]:
    """How many candidate ports there are, and process ``pid``'s endless walk over them in
    an order of its own: its successive servers never get one port twice before every
    candidate was tried, and another process (a forked child too) walks another order.
    Parallel test workers walk disjoint shares, so two never choose one port at once."""
    index, count = _worker_share()
    ports = [p for p in range(PORT_FLOOR, min(PORT_CEILING, ephemeral_low())) if p % count == index]
    random.shuffle(ports)
    return len(ports), itertools.cycle(ports)


def distinct_free_ports(count: int) -> list[int]:
    """``count`` different ports on 127.0.0.1 that nothing uses now, none a client's
    ephemeral port (all held at once while chosen, so they differ)."""
    candidates, order = _port_order(os.getpid())
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in itertools.islice(order, candidates):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or lingering in TIME_WAIT
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"fewer than {count} free ports in {PORT_FLOOR}-{PORT_CEILING}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now (see ``distinct_free_ports``)."""
    return distinct_free_ports(1)[0]


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


# How long one look of ``wait_http`` waits for its answer (a refused connection fails at once).
LOOK_S = 30.0


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers (any status), or fail with what is known. Each look
    waits up to ``LOOK_S`` for its answer: SGLang answers ``/health`` with a one-token
    generation, which a slow CPU took over a second to make, and looks cut at 1 s and asked
    again never saw one finish."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            httpx.get(url, timeout=min(LOOK_S, max(deadline - time.monotonic(), 0.1)))
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
