"""``tokcap submit``: queue finished rollout records for rebuilding.

The file holds one JSON record, a JSON list of records, or JSON Lines; ``-`` reads stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from capture.rollout_ids import rollout_id_from_run_body
from tokcap.commands.redis_url import (
    MissingUrlError,
    add_cluster_argument,
    add_url_argument,
    redis_url,
)
from tokcap.help import verb_main
from transports.rebuild.jobs import RebuildQueue
from transports.redis.keys import DEFAULT_PREFIX, stream_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.json|-", help="record(s) to submit; - for stdin")
    add_url_argument(parser)
    add_cluster_argument(parser)
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="job stream shards, as many as the workers read (default %(default)s)",
    )
    parser.add_argument(
        "--key-prefix",
        default=DEFAULT_PREFIX,
        help="the workers' --key-prefix; the jobs stream is <prefix>:rebuild (default %(default)s)",
    )
    parser.add_argument(
        "--stream",
        default=None,
        help=f"jobs stream, if not named by the prefix (default {stream_names().jobs})",
    )


def read_records(text: str) -> list[dict[str, Any]]:
    """One object, a list of objects, or one object per line."""
    text = text.strip()
    if not text:
        return []
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        loaded = [json.loads(line) for line in text.splitlines() if line.strip()]
    return loaded if isinstance(loaded, list) else [loaded]


async def _submit(
    url: str, stream: str, records: list[dict[str, Any]], shards: int = 1, cluster: bool = False
) -> list[str]:
    async with RebuildQueue(url=url, stream=stream, shards=shards, cluster=cluster) as queue:
        return [await queue.submit(record) for record in records]


def run(args: argparse.Namespace) -> int:
    try:
        url = redis_url(args.url)
    except MissingUrlError as exc:
        print(f"tokcap submit: {exc}", file=sys.stderr)
        return 2
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as handle:
                text = handle.read()
        records = read_records(text)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"tokcap submit: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    if not records:
        print(f"tokcap submit: {args.file} holds no records", file=sys.stderr)
        return 2
    stream = args.stream or stream_names(args.key_prefix).jobs
    try:
        job_ids = asyncio.run(_submit(url, stream, records, args.shards, args.cluster))
    except ValueError as exc:
        print(f"tokcap submit: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"tokcap submit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for record, job_id in zip(records, job_ids, strict=True):
        print(f"{job_id}\t{rollout_id_from_run_body(record)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap submit", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
