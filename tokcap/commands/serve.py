"""``tokcap serve``: run the front end with uvicorn (``python -m tokcap.commands.serve`` works too).

uvicorn starts its worker processes from an import string, so the settings travel to them
through the environment (TOKCAP_CONFIG, TOKCAP_UPSTREAM), set only while they run; each
worker builds its own app, sink and upstream client from the same config.

It runs like a service: the sink proves itself (Redis durability) once here, before any
worker starts, so a store that cannot keep its guarantee exits non-zero instead of N
workers printing the refusal; and a worker that still fails its start-up makes the whole
command exit non-zero (uvicorn's supervisor stops then, but returns normally). Several
workers share their Prometheus counters through a fresh PROMETHEUS_MULTIPROC_DIR, removed
at exit, so one ``/metrics`` scrape shows all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from api.edge.metrics import MULTIPROC_ENV
from api.engine.client import where
from api.prompts.faithful import FaithfulPrompts, faithful_prompts
from api.settings import ENV_CONFIG, ServerSettings, settings_from_environment
from api.startup import probe
from capture.errors import ConfigError, TokenCaptureError
from capture.protocols import StartupCheck
from tokcap.help import verb_main

APP = "api.app:create_app_from_env"
# An idle keep-alive connection is closed after this long. uvicorn's 5 s is shorter than
# what clients keep an idle connection for (aiohttp 15 s), so under load a client sent its
# next call on a connection the server was closing, and got a reset; a server should be the
# side that waits longest (nginx keeps 75 s).
IDLE_TIMEOUT_S = 75.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="Gym-style YAML with model_server and token_id_capture "
        f"(default ${ENV_CONFIG}, else built-in defaults and TOKCAP_* variables)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100, help="port to bind (default 8100)")
    parser.add_argument(
        "--workers", type=int, default=1, help="uvicorn worker processes (default 1)"
    )
    parser.add_argument(
        "--upstream",
        help="engine URL; overrides model_server.upstream (default $TOKCAP_UPSTREAM, else the "
        "config's); a URL with credentials belongs in the variable, as every local user can "
        "read a command line; they are never printed",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    parser.add_argument(
        "--skip-probe",
        action="store_true",
        help="start without the engine probe (one short call that checks ids and log-probs; "
        "default: probe)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        metavar="S",
        help="seconds an idle keep-alive connection is kept open (default %(default)g: longer "
        "than clients keep theirs, so none sends a call on a connection being closed)",
    )
    # uvicorn's event loop and HTTP parser; auto takes uvloop and httptools (uvicorn[standard]).
    parser.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop (default auto: uvloop)",
    )
    parser.add_argument(
        "--http",
        choices=["auto", "h11", "httptools"],
        default="auto",
        help="HTTP/1.1 parser (default auto: httptools)",
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help="serve the OpenAPI pages (/docs, /redoc, /openapi.json); off unless asked "
        "(model_server.docs, TOKCAP_DOCS=1)",
    )


def worker_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables the worker processes read their settings from."""
    exported = {}
    if args.config:
        exported[ENV_CONFIG] = os.path.abspath(args.config)
    if args.upstream:
        exported["TOKCAP_UPSTREAM"] = args.upstream
    if getattr(args, "docs", False):
        exported["TOKCAP_DOCS"] = "1"
    return exported


@contextlib.contextmanager
def exported(variables: dict[str, str]) -> Iterator[None]:
    """Set ``variables`` in this process's environment for the block, then restore it."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _checked_settings(
    variables: dict[str, str],
) -> tuple[ServerSettings, str, FaithfulPrompts | None]:
    """The settings, a word on capture, and the faithful prompt builder (None in text mode);
    ConfigError on a bad config, sink or renderer (once, here).

    The sink is built and, if it proves itself (``StartupCheck``: Redis durability and
    reachability), started once here: every worker would refuse the same way, and uvicorn's
    supervisor would print it N times and exit 0.
    """
    settings = settings_from_environment({**os.environ, **variables})
    # Build the sink once (path, kwargs, structural checks); each worker builds its own.
    sink = settings.build_sink()
    if sink is not None:
        asyncio.run(_started_then_closed(sink))
    capture = "off"
    if settings.capture.enabled:
        capture = (
            "on"
            if sink is not None
            else "on, but no dir or sink is configured: tagged calls are served, not captured"
        )
    prompts = faithful_prompts(settings)  # a renderer that cannot load fails here
    if prompts is not None:
        capture += f"; faithful prompts: {settings.renderer.name} on {settings.renderer.tokenizer}"
    return settings, capture, prompts


async def _started_then_closed(sink: Any) -> None:
    try:
        if isinstance(sink, StartupCheck):
            await sink.start()
    finally:
        await sink.close()


@contextlib.contextmanager
def metrics_directory(workers: int) -> Iterator[dict[str, str]]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for several workers (none for one), removed at exit.

    Fresh, because prometheus_client sums every file it finds there: counts a previous run
    left would be added to this one's.
    """
    if workers <= 1:
        yield {}
        return
    path = tempfile.mkdtemp(prefix="tokcap-metrics-")
    try:
        yield {MULTIPROC_ENV: path}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def serve(config: Any) -> int:
    """Run uvicorn; 1 when a worker failed its start-up (uvicorn itself would return)."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    if config.workers <= 1:
        server = uvicorn.Server(config)
        server.run()  # a failed start-up exits with uvicorn's STARTUP_FAILURE itself
        return 0 if server.started else 1
    supervisor = Multiprocess(config, sockets=[config.bind_socket()])
    supervisor.run()
    # A worker that failed start-up stops the supervisor, which then returns normally: its
    # exit code, kept on the process it did not replace, is the only trace.
    failed = [p.pid for p in supervisor.processes if p.exitcode == STARTUP_FAILURE]
    if failed:
        print(
            f"tokcap serve: worker(s) {', '.join(map(str, failed))} failed to start; stopped",
            file=sys.stderr,
        )
        return 1
    return 0


# Each call in flight holds two sockets: the harness's connection and the engine's; a
# worker needs a few dozen more for its store, its logs and its listening socket.
SOCKETS_PER_CALL, SPARE_FILES = 2, 64


def open_file_room() -> str:
    """Raise the open-file limit to its hard limit (the workers inherit it) and say how
    many calls in flight it allows per worker; a low limit is warned about, not refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    calls = max(0, (soft - SPARE_FILES) // SOCKETS_PER_CALL)
    room = f"open files: {soft} per worker, about {calls} calls in flight"
    if calls < 1000:
        room += " (raise the hard limit, ulimit -Hn, for more)"
    return room


def run(args: argparse.Namespace) -> int:
    import uvicorn

    variables = worker_environment(args)
    try:
        settings, capture, prompts = _checked_settings(variables)
        report = None if args.skip_probe else asyncio.run(probe(settings, prompts))
    except ConfigError as exc:  # EngineRefused included: it names the setting to change
        print(f"tokcap serve: {exc}", file=sys.stderr)
        return 2
    except (TokenCaptureError, OSError) as exc:  # a sink that cannot be reached, say
        print(f"tokcap serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    engine = (
        report.banner()
        if report is not None
        else "upstream " + ", ".join(where(e.url) for e in settings.engines)
    )
    print(
        f"tokcap serve: http://{args.host}:{args.port} -> {engine} "
        f"(capture {capture}, {args.workers} worker(s); {open_file_room()})",
        file=sys.stderr,
    )
    for warning in report.warnings if report is not None else ():
        print(f"tokcap serve: warning: {warning}", file=sys.stderr)
    with metrics_directory(args.workers) as metrics, exported({**variables, **metrics}):
        config = uvicorn.Config(
            APP,
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            loop=args.loop,
            http=args.http,
            timeout_keep_alive=args.idle_timeout,
        )
        return serve(config)


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap serve", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
