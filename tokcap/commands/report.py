"""``tokcap report``: a run's results at a glance, step by step, and what a first run should flag.

The records come from files or the results stream (``tokcap.report.reading``), are grouped
by training step and counted (``tokcap.report.steps``, ``tokcap.report.figures``) and shown
as tables, JSON or PNGs: the histograms of all records (``tokcap.report.drawing``) and the
trend over steps (``tokcap.report.trends``).
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
from tokcap.report.drawing import plot
from tokcap.report.reading import BadInput, read_jsonl, read_stream
from tokcap.report.steps import StepReport, report_steps
from tokcap.report.trends import plot_trends, render_report
from transports.redis.keys import DEFAULT_PREFIX, MAX_SHARDS, stream_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="*",
        metavar="FILE.jsonl|-",
        help="finished records, one per line, read in the order given (a later result of a "
        "rollout replaces an earlier one); - for stdin",
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
        "--step-field",
        metavar="NAME",
        help="group records by this top-level field of each record (an integer or a name) "
        "instead of the step{N}. that opens the rollout id (step{N}.{task}-{rollout})",
    )
    parser.add_argument(
        "--png", metavar="PATH", help="also draw the histograms of all records into this PNG"
    )
    parser.add_argument(
        "--trend-png",
        metavar="PATH",
        help="also draw the trend over steps into this PNG: masked, one-call and delivered "
        "fractions, policy version lag",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the figures as JSON, each step's under steps"
    )


def _records(args: argparse.Namespace) -> tuple[Iterator[dict[str, Any]], str]:
    """The records to report on, and what they came from."""
    if args.files and args.url is not None:
        raise BadInput("give a FILE (or several, or - for stdin) or --url URL, not both")
    if args.files:
        if args.files.count("-") > 1:
            raise BadInput("- (stdin) can be read once")
        records = (record for path in args.files for record in read_jsonl(path))
        return records, ", ".join(args.files)
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


def _report(args: argparse.Namespace) -> StepReport:
    """The records read and grouped by step; BadInput for input that cannot be reported on."""
    records, source = _records(args)
    report = report_steps(records, args.step_field)
    if not report.figures.rollouts:
        hint = " (the trainer deletes the results it acknowledges)" if not args.files else ""
        raise BadInput(f"{source} holds no records{hint}")
    if args.trend_png and not report.stepped:
        raise BadInput(
            "--trend-png: no record names a step (a rollout id step{N}.{task}-{rollout}, "
            "or the field --step-field names)"
        )
    return report


def run(args: argparse.Namespace) -> int:
    try:
        report = _report(args)
        _draw(args, report)
    except BadInput as exc:
        print(f"tokcap report: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # Redis unreachable, and the like: not the input's fault
        print(f"tokcap report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        render_report(report, Console())
    return 0


def _draw(args: argparse.Namespace, report: StepReport) -> None:
    """The PNGs asked for; a path that cannot be written is the input's fault, as is a PNG
    asked for without matplotlib."""
    try:
        if args.png:
            plot(report.figures, args.png)
        if args.trend_png:
            plot_trends(report, args.trend_png)
    except ImportError as exc:
        raise BadInput("a PNG needs matplotlib: pip install 'tokcap[report]'") from exc
    except OSError as exc:
        raise BadInput(f"cannot write {exc.filename or 'the PNG'}: {exc.strerror or exc}") from exc


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap report", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
