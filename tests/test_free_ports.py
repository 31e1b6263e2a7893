"""The ports test servers listen on: free, distinct, and outside the range the kernel hands
to any connect() or bind(0), so nothing can take one while its server is still starting."""

from __future__ import annotations

import multiprocessing
import socket
from multiprocessing.connection import Connection

import pytest

from tokcap_devtools import processes
from tokcap_devtools.processes import distinct_free_ports, ephemeral_low, free_port


def test_ports_lie_below_the_range_client_connections_take_theirs_from() -> None:
    ports = [free_port() for _ in range(50)] + distinct_free_ports(20)
    assert all(1024 < port < ephemeral_low() for port in ports)


def test_distinct_ports_differ_and_each_can_be_bound() -> None:
    ports = distinct_free_ports(12)
    assert len(set(ports)) == 12
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        # The held port is the first candidate tried.
        order = (4, iter([taken, *distinct_free_ports(3)]))
        monkeypatch.setattr(processes, "_port_order", lambda pid: order)
        ports = distinct_free_ports(3)
    assert taken not in ports and len(set(ports)) == 3


def test_one_process_gets_no_port_twice_before_it_tried_them_all() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == 500


def _ports_in_child(pipe: Connection) -> None:
    pipe.send([free_port() for _ in range(5)])


def test_a_forked_child_walks_its_own_order() -> None:
    free_port()  # this process's order exists before the fork
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_ports_in_child, args=(child,))
    process.start()
    try:
        theirs = parent.recv()
    finally:
        process.join(timeout=10)
    assert theirs != [free_port() for _ in range(5)]


def test_parallel_test_workers_walk_disjoint_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest-xdist each worker process takes its ports from a share of its own."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    shares = []
    for name in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", name)
        processes._port_order.cache_clear()
        shares.append({port % 3 for port in distinct_free_ports(30)})
    processes._port_order.cache_clear()  # the real environment's order again
    assert shares == [{0}, {1}, {2}]
