"""``tokcap report``: one step's results at a glance, and what a first run should flag.

The records come from a file or the results stream (``tokcap.report.reading``), are counted
(``tokcap.report.figures``) and shown as a table, JSON or a PNG (``tokcap.report.drawing``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from tokcap.commands.redis_url import URL_ENV, add_cluster_argument, named_url
from tokcap.help import verb_main
from tokcap.report.drawing import plot, render
from tokcap.report.figures import compute_figures
from tokcap.report.reading import BadInput, read_jsonl, read_stream
from transports.redis.keys import DEFAULT_PREFIX, MAX_SHARDS, stream_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        metavar="FILE.jsonl|-",
        help="finished records, one per line; - for stdin",
    )
    parser.add_argument(
        "--url",
        help=f"read the results stream of this Redis instead of a file (default: with no FILE, "
        f"${URL_ENV} if set; prefer the variable, an argument's password is visible to all)",
    )
    parser.add_argument(
        "--key-prefix",
        default=DEFAULT_PREFIX,
        help="the workers' --key-prefix; results are on <prefix>:results (default %(default)s)",
    )
    parser.add_argument(
        "--stream",
        help=f"results stream, if not named by the prefix (default {stream_names().results})",
    )
    add_cluster_argument(parser)
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="the workers' --shards: read every shard of the results stream (default 1)",
    )
    parser.add_argument(
        "--png", metavar="PATH", help="also draw the histograms into this PNG (default: none)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _records(args: argparse.Namespace) -> tuple[Iterator[dict[str, Any]], str]:
    """The records to report on, and what they came from."""
    if args.file is not None and args.url is not None:
        raise BadInput("give a FILE (or - for stdin) or --url URL, not both")
    if args.file is not None:
        return read_jsonl(args.file), args.file
    url = named_url(args.url)
    if not url:
        raise BadInput(
            f"give a FILE (or - for stdin) or --url URL (or set {URL_ENV}) for the results stream"
        )
    stream = args.stream or stream_names(args.key_prefix).results
    if not 1 <= args.shards <= MAX_SHARDS:
        raise BadInput(f"--shards must be within 1..{MAX_SHARDS}, not {args.shards}")
    where = f"stream {stream}" + (f" ({args.shards} shards)" if args.shards > 1 else "")
    return read_stream(url, stream, args.shards, args.cluster), where


def run(args: argparse.Namespace) -> int:
    try:
        records, source = _records(args)
        figures = compute_figures(records)
    except BadInput as exc:
        print(f"tokcap report: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # Redis unreachable, and the like: not the input's fault
        print(f"tokcap report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not figures.rollouts:
        hint = " (the trainer deletes the results it acknowledges)" if args.file is None else ""
        print(f"tokcap report: {source} holds no records{hint}", file=sys.stderr)
        return 2
    if args.png:
        try:
            plot(figures, args.png)
        except OSError as exc:
            print(f"tokcap report: cannot write {args.png}: {exc}", file=sys.stderr)
            return 2
        except ImportError:
            print(
                "tokcap report: --png needs matplotlib: pip install 'tokcap[report]'",
                file=sys.stderr,
            )
            return 2
    if args.json:
        print(json.dumps(figures.as_dict()))
    else:
        render(figures, Console())
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap report", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
