"""Readiness (issue 14): ``/ready`` answers 200 only when the sink and the upstream answer.

``/health`` says the process lives; ``/ready`` asks the sink (a Redis PING through the
store's own client; the file store's directory) and the upstream (``GET /v1/models``), and
answers 503 naming what is not ready as host:port, never a password.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from api.edge.status import READY_TIMEOUT_S
from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from tests.support.frontend import both_servers, engine_server, file_store_settings, front_end
from tokcap_devtools.processes import free_port

REDIS_PASSWORD = "redis-pass-7f3a9c"
UPSTREAM_PASSWORD = "upstream-pass-51e0"


def test_ready_when_the_file_store_and_the_engine_answer(tmp_path: Path) -> None:
    with both_servers(tmp_path / "captures") as servers:
        response = httpx.get(servers.front + "/ready", timeout=30)
    engine = {"engine": servers.engine, "state": "up", "in_flight": 0, "served": 0, "failed": 0}
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "engines": [{**engine, "ejections": 0}]}


def test_ready_without_a_sink_asks_only_the_upstream() -> None:
    with engine_server() as engine, front_end(ServerSettings(upstream=engine)) as front:
        assert httpx.get(front + "/ready", timeout=30).status_code == 200


def test_not_ready_names_the_upstream_that_does_not_answer(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    upstream = f"http://user:{UPSTREAM_PASSWORD}@127.0.0.1:{port}"
    settings = file_store_settings(upstream, tmp_path / "captures")
    with front_end(settings) as front:
        assert httpx.get(front + "/health", timeout=30).status_code == 200, "alive all the same"
        response = httpx.get(front + "/ready", timeout=30)
    assert response.status_code == 503
    problems = response.json()["problems"]
    assert set(problems) == {"upstream"}
    assert f"127.0.0.1:{port}" in problems["upstream"]
    assert UPSTREAM_PASSWORD not in response.text and "user:" not in response.text


def test_ready_follows_the_redis_sink(redis_server_factory, redis_prefix: str) -> None:
    server = redis_server_factory(requirepass=REDIS_PASSWORD)
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"
    capture = TokenIdCaptureConfig(
        enabled=True,
        sink="transports.redis:RedisTokenSink",
        sink_kwargs={"url": url, "key_prefix": redis_prefix},
    )
    with (
        engine_server() as engine,
        front_end(ServerSettings(upstream=engine, capture=capture)) as front,
    ):
        assert httpx.get(front + "/ready", timeout=30).status_code == 200
        server.stop()
        response = httpx.get(front + "/ready", timeout=30)
    assert response.status_code == 503
    problems = response.json()["problems"]
    assert set(problems) == {"sink"}
    assert f"127.0.0.1:{server.port}" in problems["sink"]
    assert REDIS_PASSWORD not in response.text


def test_an_upstream_that_never_answers_is_not_ready_within_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        upstream = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with front_end(file_store_settings(upstream, tmp_path / "captures")) as front:
            started = time.monotonic()
            response = httpx.get(front + "/ready", timeout=30)
            took = time.monotonic() - started
    assert response.status_code == 503 and set(response.json()["problems"]) == {"upstream"}
    assert took < READY_TIMEOUT_S + 2, f"a probe waited {took:.1f} s"


def test_ready_and_metrics_show_the_redis_memory_headroom(
    redis_server_factory, redis_prefix: str
) -> None:
    """Used memory against maxmemory, per server: seen before a full Redis refuses writes."""
    server = redis_server_factory(maxmemory="48mb")
    capture = TokenIdCaptureConfig(
        enabled=True,
        sink="transports.redis:RedisTokenSink",
        sink_kwargs={"url": server.url, "key_prefix": redis_prefix},
    )
    with (
        engine_server() as engine,
        front_end(ServerSettings(upstream=engine, capture=capture)) as front,
    ):
        ready = httpx.get(front + "/ready", timeout=30)
        scraped = httpx.get(front + "/metrics", timeout=30).text
    assert ready.status_code == 200
    (memory,) = ready.json()["redis_memory"]
    assert memory["server"] == f"redis at 127.0.0.1:{server.port}"
    assert memory["max_bytes"] == 48 * 1024 * 1024 and memory["policy"] == "noeviction"
    assert 0 < memory["used_bytes"] < memory["max_bytes"]
    label = f'server="127.0.0.1:{server.port}"'
    gauges = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith("tokcap_redis_")
    }
    assert gauges[f"tokcap_redis_maxmemory_bytes{{{label}}}"] == 48 * 1024 * 1024
    assert 0 < gauges[f"tokcap_redis_used_memory_bytes{{{label}}}"] < 48 * 1024 * 1024
