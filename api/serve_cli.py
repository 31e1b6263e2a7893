"""``tokcap serve``: run the front end with uvicorn (``python -m api.serve_cli`` works too).

uvicorn starts its worker processes from an import string, so the settings travel to them
through the environment (TOKCAP_CONFIG, TOKCAP_UPSTREAM), set only around ``uvicorn.run``;
each worker builds its own app, sink and upstream client from the same config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator

from api.probe import probe
from api.prompts.faithful import faithful_prompts
from api.settings import ENV_CONFIG, ServerSettings, settings_from_environment
from api.upstream import where
from capture.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="Gym-style YAML with model_server and token_id_capture")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100, help="port to bind (default 8100)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--upstream", help="engine URL; overrides model_server.upstream")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    parser.add_argument(
        "--skip-probe",
        action="store_true",
        help="start without the engine probe (one short call that checks ids and log-probs)",
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


def worker_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables the worker processes read their settings from."""
    exported = {}
    if args.config:
        exported[ENV_CONFIG] = os.path.abspath(args.config)
    if args.upstream:
        exported["TOKCAP_UPSTREAM"] = args.upstream
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


def _checked_settings(variables: dict[str, str]) -> tuple[ServerSettings, str]:
    """The settings and a word on capture; ConfigError on a bad config or sink (once, here)."""
    settings = settings_from_environment({**os.environ, **variables})
    # Build the sink once (path, kwargs, structural checks); each worker builds its own.
    sink = settings.build_sink()
    if sink is not None:
        asyncio.run(sink.close())
    capture = "off"
    if settings.capture.enabled:
        capture = (
            "on"
            if sink is not None
            else "on, but no dir or sink is configured: tagged calls are served, not captured"
        )
    if faithful_prompts(settings) is not None:  # a renderer that cannot load fails here
        capture += f"; faithful prompts: {settings.renderer_name} on {settings.renderer_tokenizer}"
    return settings, capture


def run(args: argparse.Namespace) -> int:
    import uvicorn

    variables = worker_environment(args)
    try:
        settings, capture = _checked_settings(variables)
        report = None if args.skip_probe else asyncio.run(probe(settings))
    except ConfigError as exc:  # EngineRefused included: it names the setting to change
        print(f"tokcap serve: {exc}", file=sys.stderr)
        return 2
    engine = report.banner() if report is not None else f"upstream {where(settings.upstream)}"
    print(
        f"tokcap serve: http://{args.host}:{args.port} -> {engine} "
        f"(capture {capture}, {args.workers} worker(s))",
        file=sys.stderr,
    )
    for warning in report.warnings if report is not None else ():
        print(f"tokcap serve: warning: {warning}", file=sys.stderr)
    with exported(variables):
        uvicorn.run(
            "api.app:create_app_from_env",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            loop=args.loop,
            http=args.http,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokcap serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
