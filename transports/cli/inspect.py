"""``tokcap inspect <rollout_id>``: what is captured for one rollout, from Redis or a directory.

Read-only: it shows the store's ``inspect()`` (``capture.inspection.Inspection``: calls,
tokens, state, version, incomplete, tombstone) and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from capture.errors import InvalidRolloutIdError
from capture.rollout_ids import validate_rollout_id
from transports.redis.keys import DEFAULT_PREFIX


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rollout_id", help="the rollout to show")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="Redis URL of a Redis store (default $TOKCAP_REDIS_URL)")
    where.add_argument("--dir", help="directory of a file store")
    parser.add_argument(
        "--key-prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


async def inspect_rollout(
    rollout_id: str,
    *,
    url: str | None = None,
    dir: str | None = None,
    key_prefix: str = DEFAULT_PREFIX,
) -> dict[str, Any]:
    """The store's ``inspect()`` for one rollout."""
    if dir is not None:
        from capture.filestore.store import TokenCaptureStore

        if not Path(dir).is_dir():
            raise FileNotFoundError(f"{dir} is not a directory of a file store")
        store: Any = TokenCaptureStore(dir)
    else:
        from transports.redis import RedisTokenStore

        # Read-only: no write needs the durability guarantee, so none is demanded.
        store = RedisTokenStore(url=url, key_prefix=key_prefix, durability="none")
    try:
        # The store's warning about durability='none' is about writes: it would only
        # confuse a reader, so it is held back for this call and nothing else.
        with _errors_only(logging.getLogger("tokcap.redis")):
            return await store.inspect(rollout_id)
    finally:
        await store.close()


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def _errors_only(logger: logging.Logger) -> Iterator[None]:
    """Let only errors of ``logger`` through inside the block; it is left as it was."""
    held_back = _ErrorsOnly()
    logger.addFilter(held_back)
    try:
        yield
    finally:
        logger.removeFilter(held_back)


def _cell(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value)) if value else "-"
    if value is None or value == "":
        return "-"
    return str(value)


def render(info: dict[str, Any], console: Console) -> None:
    table = Table(title=f"rollout {info.get('rollout_id', '')}", show_header=True)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name, value in info.items():  # in the order of capture.inspection.Inspection
        table.add_row(name, _cell(value))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    try:
        validate_rollout_id(args.rollout_id)
    except InvalidRolloutIdError as exc:
        print(f"tokcap inspect: {exc}", file=sys.stderr)
        return 2
    url = args.url or (None if args.dir else os.environ.get("TOKCAP_REDIS_URL"))
    if url is None and args.dir is None:
        print(
            "tokcap inspect: give --url URL (or set TOKCAP_REDIS_URL) or --dir DIR", file=sys.stderr
        )
        return 2
    try:
        info = asyncio.run(
            inspect_rollout(args.rollout_id, url=url, dir=args.dir, key_prefix=args.key_prefix)
        )
    except Exception as exc:
        print(f"tokcap inspect: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, default=str))
    else:
        render(info, Console())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokcap inspect", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
