"""``tokcap serve`` as a service: start-up failures exit non-zero, one scrape counts every
worker, and no credential reaches a response body, a log line, the banner or ``--help``.

Each test runs the real command as a child process with two uvicorn workers, its output in
a file read at the end; the sink is a password-protected private redis-server and the
upstream URL carries a user and password.
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from api.edge.metrics import MULTIPROC_ENV
from capture.errors import ConfigError
from capture.filestore.store import FileTokenStore
from tests.support.frontend import REDIS_SERVE_CONFIG, engine_server
from tokcap_devtools.processes import free_port, stop_process, wait_http

REDIS_SECRET = "redis-pw-8a1f3c"
UPSTREAM_USER, UPSTREAM_SECRET = "gymuser", "upstream-pw-77d2e9"
SECRETS = (REDIS_SECRET, UPSTREAM_SECRET, UPSTREAM_USER)


class FailsInWorkers(FileTokenStore):
    """A file store that refuses to start in a worker only (where serve set the metrics
    directory), as a sink whose trouble the parent's check cannot see would."""

    async def start(self) -> None:
        if MULTIPROC_ENV in os.environ:
            raise ConfigError("this sink refuses to start in a worker")


def _with_credentials(url: str) -> str:
    """``url`` with the test's user and password in it."""
    return url.replace("http://", f"http://{UPSTREAM_USER}:{UPSTREAM_SECRET}@", 1)


def _redis_url(port: int, password: str = REDIS_SECRET) -> str:
    return f"redis://:{password}@127.0.0.1:{port}/0"


def _serve_args(config: Path, port: int, upstream: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokcap.cli",
        "serve",
        "--config",
        str(config),
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--workers",
        "2",
        "--log-level",
        "debug",
        *extra,
    ]


@contextmanager
def serving(args: list[str], log: Path, env: dict[str, str]) -> Iterator[str]:
    """The command running, until the block ends; its output goes to ``log``."""
    port = args[args.index("--port") + 1]
    with open(log, "wb") as output:
        proc = subprocess.Popen(
            args,
            env={**os.environ, **env},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            try:
                wait_http(base + "/health", timeout=60, proc=proc)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{exc}\n{log.read_text()[-3000:]}") from None
            yield base
        finally:
            code = stop_process(proc)
    # SIGTERM is how a service manager stops it: a clean stop, not a failure.
    assert code == 0, log.read_text()[-3000:]


def assert_no_secret(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} in {where}: {text[-2000:]}"


def _counter(exposition: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", exposition, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_two_workers_share_their_metrics_and_print_no_credential(
    tmp_path: Path, redis_server_factory
) -> None:
    redis = redis_server_factory(requirepass=REDIS_SECRET)
    config = tmp_path / "serve.yaml"
    config.write_text(REDIS_SERVE_CONFIG)
    log = tmp_path / "serve.log"
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"TOKCAP_REDIS_URL": _redis_url(redis.port), "TMPDIR": str(temp)}
    calls = 8
    with engine_server() as engine:
        args = _serve_args(config, free_port(), _with_credentials(engine))
        with serving(args, log, env) as base:
            for number in range(calls):
                # A new connection per call: uvicorn's workers share the socket, so calls
                # land on both of them.
                with httpx.Client() as client:
                    reply = client.post(
                        f"{base}/ng-rollout/metrics-{number % 2}/training-token-capture"
                        "/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    )
                assert reply.status_code == 200, (reply.text, log.read_text()[-3000:])
            scrapes = []
            for _ in range(4):  # each scrape on a new connection, so on either worker
                with httpx.Client() as client:
                    scrapes.append(client.get(f"{base}/metrics").text)
    for exposition in scrapes:
        assert _counter(exposition, "tokcap_captured_calls_total") == calls
        assert_no_secret("/metrics", exposition)
    assert not list(temp.glob("tokcap-metrics-*")), "the metrics directory outlived serve"
    output = log.read_text()
    assert "tokcap serve: http://127.0.0.1" in output  # the banner
    assert_no_secret("the server's output", output)


def test_a_bad_gateway_names_the_upstream_by_host_and_port_only(
    tmp_path: Path, redis_server_factory
) -> None:
    redis = redis_server_factory(requirepass=REDIS_SECRET)
    config = tmp_path / "serve.yaml"
    config.write_text(REDIS_SERVE_CONFIG)
    log = tmp_path / "serve.log"
    nothing = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = _serve_args(config, free_port(), _with_credentials(nothing))
    bodies = []
    with serving(args, log, {"TOKCAP_REDIS_URL": _redis_url(redis.port)}) as base:
        for path, body in (
            (
                "/ng-rollout/bad-gateway-1/training-token-capture/v1/messages",
                {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            ),
            (
                "/ng-rollout/bad-gateway-2/training-token-capture/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "x"}]},
            ),
        ):
            reply = httpx.post(base + path, json=body)
            assert reply.status_code >= 500, reply.text
            bodies.append(reply.text)
    for body in bodies:
        assert_no_secret("a 5xx body", body)
    assert any(nothing.removeprefix("http://") in body for body in bodies), bodies
    output = log.read_text()
    assert "probe skipped" in output
    assert_no_secret("the server's output", output)


def _serve_on(tmp_path: Path, redis: Any) -> subprocess.CompletedProcess:
    """``tokcap serve`` on a private Redis the sink must refuse; its finished process."""
    config = tmp_path / "serve.yaml"
    config.write_text(REDIS_SERVE_CONFIG)
    args = _serve_args(config, free_port(), "http://127.0.0.1:1", "--skip-probe")
    return subprocess.run(
        args,
        env={**os.environ, "TOKCAP_REDIS_URL": _redis_url(redis.port)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_worker_that_fails_start_up_fails_the_command(
    tmp_path: Path, redis_server_factory
) -> None:
    """Redis without AOF: the sink refuses in the parent, before any worker starts."""
    done = _serve_on(tmp_path, redis_server_factory(appendonly="no", requirepass=REDIS_SECRET))
    assert done.returncode != 0, done.stderr[-2000:]
    assert done.stderr.count("AOF is off") == 1  # once, not once per worker
    assert_no_secret("the refusal", done.stdout + done.stderr)


def test_an_evicting_redis_fails_the_command_naming_the_fix(
    tmp_path: Path, redis_server_factory
) -> None:
    """An allkeys-* Redis would delete rollouts under memory pressure: refused at start-up."""
    policy = {"maxmemory-policy": "allkeys-lru"}
    done = _serve_on(tmp_path, redis_server_factory(requirepass=REDIS_SECRET, **policy))
    assert done.returncode != 0, done.stderr[-2000:]
    assert done.stderr.count("maxmemory-policy allkeys-lru") == 1
    assert "set maxmemory-policy noeviction" in done.stderr and "Traceback" not in done.stderr
    assert_no_secret("the refusal", done.stdout + done.stderr)


def test_an_unreachable_sink_fails_the_command(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(REDIS_SERVE_CONFIG)
    args = _serve_args(config, free_port(), "http://127.0.0.1:1", "--skip-probe")
    done = subprocess.run(
        args,
        env={**os.environ, "TOKCAP_REDIS_URL": _redis_url(free_port())},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stderr[-2000:]
    assert "unreachable" in done.stderr and "Traceback" not in done.stderr
    assert_no_secret("the refusal", done.stdout + done.stderr)


def test_a_worker_failing_after_the_parent_checks_fails_the_command(tmp_path: Path) -> None:
    """A failure only the workers meet (here a sink that refuses in workers only) still
    ends the command non-zero: uvicorn's supervisor stops, and serve reports it."""
    config = tmp_path / "serve.yaml"
    config.write_text(
        "token_id_capture:\n  enabled: true\n"
        "  sink: tests.api.test_serve_service:FailsInWorkers\n"
        f"  sink_kwargs: {{dir: '{tmp_path / 'captures'}'}}\n  rebuild_response: false\n"
    )
    args = _serve_args(config, free_port(), "http://127.0.0.1:1", "--skip-probe")
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stderr[-3000:]
    assert "failed to start" in done.stderr


def test_an_idle_connection_is_kept_longer_than_clients_keep_theirs(
    tmp_path: Path, redis_server_factory
) -> None:
    """A client idle 6 s on a kept-alive connection (aiohttp keeps one 15 s) sends its next
    call on it: uvicorn's own 5 s would have closed it, and the call would be reset."""
    redis = redis_server_factory(requirepass=REDIS_SECRET)
    config = tmp_path / "serve.yaml"
    config.write_text(REDIS_SERVE_CONFIG)
    port = free_port()
    env = {"TOKCAP_REDIS_URL": _redis_url(redis.port)}
    with (
        engine_server() as engine,
        serving(_serve_args(config, port, engine), tmp_path / "log", env),
    ):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("GET", "/health")
            assert connection.getresponse().read()
            kept = connection.sock
            time.sleep(6)
            connection.request("GET", "/health")
            reply = connection.getresponse()
            assert reply.status == 200 and reply.read()
            assert connection.sock is kept  # the same connection, still open
        finally:
            connection.close()
