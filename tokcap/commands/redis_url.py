"""Which Redis a command talks to: ``--url`` or TOKCAP_REDIS_URL, and never a guess.

The one place the variable is read: ``redis_url`` for the commands that need a Redis,
``named_url`` for those that can read a file or a directory instead.

A command that silently fell back to ``redis://127.0.0.1:6379/0`` would queue jobs or
rebuild rollouts on whatever Redis happens to run there. The URL carries the password, so
help texts name the variable instead of showing its value, and the README passes it
through the environment: an argument is readable by anyone in ``/proc/PID/cmdline``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

URL_ENV = "TOKCAP_REDIS_URL"


class MissingUrlError(ValueError):
    """Neither --url nor TOKCAP_REDIS_URL names a Redis."""


def add_url_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help=f"Redis URL, rediss:// for TLS (default ${URL_ENV}; prefer the variable: an "
        "argument's password is visible to every local user)",
    )


def add_cluster_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the URL names one node of a Redis Cluster (the client finds the others)",
    )


def named_url(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``--url`` if given, else TOKCAP_REDIS_URL; None when neither names one. For a command
    that can read from elsewhere too (a file, a directory) and says so in its own words."""
    return given or (os.environ if environ is None else environ).get(URL_ENV)


def redis_url(given: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``--url`` if given, else TOKCAP_REDIS_URL; MissingUrlError names both."""
    url = named_url(given, environ)
    if not url:
        raise MissingUrlError(f"give --url URL or set {URL_ENV}: no Redis is assumed")
    return url
