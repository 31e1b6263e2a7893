"""``tokcap report``: one step's results at a glance, and what a first run should flag.

The input is finished rollout records: a JSON Lines file (``-`` for stdin) or the results
stream in Redis, read whole with XRANGE so the trainer's consumer group is left as it was.
``compute_figures`` turns records into ``Figures`` and does nothing else; the table, the JSON
and the PNG are views of those figures. Only the latest result of a rollout counts: a later
one is authoritative (it supersedes the earlier one, or rebuilt a resubmitted record).
Metric keys this report does not know are listed, never an error, since the record grows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from capture.delivery import METRICS_KEY
from capture.rollout_ids import rollout_id_from_run_body
from capture.summary import SUMMARY_KEYS
from tokcap.help import verb_main
from transports.cli.redis_url import URL_ENV, add_cluster_argument
from transports.rebuild.layout import layout_key, mismatch
from transports.rebuild.results import decode_result
from transports.redis.keys import DEFAULT_PREFIX, MAX_SHARDS, as_text, shard_names, stream_names

SEGMENTS_KEY = "_ng_token_segments"
CHAIN_BINS = ("0", "1", "2", "3", "4+")
FRACTION_BINS = (*(f"{i / 10:.1f}-{(i + 1) / 10:.1f}" for i in range(10)), "1.0")
NO_REASON = "(no reason given)"

# What a first run should flag. One call per rollout means the harness's loop never went
# through the capture prefix more than once: the agentic path never ran.
SINGLE_CALL_WARN = 0.5  # share of rebuilt rollouts with n_calls == 1
LOW_DELIVERY = 0.5  # an unmasked rollout delivering less than this share of its tokens ...
LOW_DELIVERY_WARN = 0.1  # ... is flagged when this share of unmasked rollouts does
MASK_RATE_WARN = 0.2

_STREAM_PAGE = 64  # results per XRANGE reply; each holds a whole final context


class BadInput(ValueError):
    """Input the report cannot read; the message names the file or stream and the place."""


@dataclass
class Figures:
    """What ``tokcap report`` shows; every count is of rollouts unless it says tokens."""

    rollouts: int = 0
    replaced_results: int = 0  # earlier results a later one of the same rollout replaced
    never_rebuilt: int = 0  # no _ng_token_capture
    rebuilt: int = 0
    single_call: int = 0  # rebuilt with n_calls == 1: the agentic path never ran
    masked: int = 0
    unmasked_rebuilt: int = 0
    build_errors: int = 0
    mask_reasons: dict[str, int] = field(default_factory=dict)  # by reason group
    chains: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHAIN_BINS, 0))
    # Of unmasked rebuilt rollouts: a masked one trains on nothing, whatever it delivered.
    delivered_fraction: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FRACTION_BINS, 0)
    )
    low_delivery: int = 0  # unmasked rollouts delivering < LOW_DELIVERY
    tokens_captured: int = 0
    tokens_delivered: int = 0
    tokens_delivered_unmasked: int = 0  # what training sees
    faithful_fallbacks: dict[str, int] = field(default_factory=dict)
    rollouts_with_segments: int = 0
    segments_by_role: dict[str, int] = field(default_factory=dict)
    other_metrics: dict[str, int] = field(default_factory=dict)  # unknown keys, by rollouts
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The figures and their rates, as ``--json`` prints them."""
        return {
            **asdict(self),
            "single_call_share": share(self.single_call, self.rebuilt),
            "mask_rate": share(self.masked, self.rollouts),
            "mask_rate_by_reason": {
                reason: share(n, self.rollouts) for reason, n in self.mask_reasons.items()
            },
            "delivered_token_share": share(self.tokens_delivered, self.tokens_captured),
        }


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


# -- figures -----------------------------------------------------------------------------


def compute_figures(records: Iterable[Mapping[str, Any]]) -> Figures:
    """The figures of one step's finished records (in publish order: later ones win)."""
    latest, replaced = latest_results(slim(record) for record in records)
    figures = Figures(rollouts=len(latest), replaced_results=replaced)
    reasons: Counter[str] = Counter()
    for record in latest:
        _tally_record(figures, record, reasons)
    figures.mask_reasons = dict(reasons.most_common())
    figures.warnings = warnings_of(figures)
    return figures


def slim(record: Mapping[str, Any]) -> dict[str, Any]:
    """Only what the report reads: a record's token arrays can be a whole final context."""
    kept = {"rollout": _rollout_of(record), "mask_sample": bool(record.get("mask_sample"))}
    if METRICS_KEY in record:
        kept[METRICS_KEY] = record[METRICS_KEY]
    segments = record.get(SEGMENTS_KEY)
    if isinstance(segments, list):
        kept[SEGMENTS_KEY] = [_role_of(segment) for segment in segments]
    return kept


def _rollout_of(record: Mapping[str, Any]) -> str | None:
    try:
        return rollout_id_from_run_body(record)
    except Exception:  # a malformed id is still one rollout: its record is its own
        raw = record.get("_ng_rollout_id")
        return None if raw is None else str(raw)


def _role_of(segment: Any) -> str:
    role = segment.get("role") if isinstance(segment, Mapping) else None
    return str(role) if role is not None else "?"


def latest_results(records: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The latest result of each rollout, and how many earlier ones it replaced.

    A later result of the same rollout is authoritative: it supersedes the earlier one
    (``_ng_supersedes``) or rebuilt a resubmitted record. A record naming no rollout stands
    alone.
    """
    by_rollout: dict[Any, dict[str, Any]] = {}
    seen = 0
    for seen, record in enumerate(records, 1):
        by_rollout[record["rollout"] if record["rollout"] is not None else -seen] = record
    return list(by_rollout.values()), seen - len(by_rollout)


def _tally_record(figures: Figures, record: dict[str, Any], reasons: Counter[str]) -> None:
    masked = record["mask_sample"]
    figures.masked += masked
    roles = record.get(SEGMENTS_KEY)
    if roles is not None:
        figures.rollouts_with_segments += 1
        _add(figures.segments_by_role, Counter(roles))
    metrics = record.get(METRICS_KEY)
    if not isinstance(metrics, Mapping):
        figures.never_rebuilt += 1
        return
    figures.rebuilt += 1
    figures.single_call += _int(metrics.get("n_calls")) == 1
    figures.build_errors += bool(metrics.get("error"))
    figures.chains[_chain_bin(_int(metrics.get("chains")))] += 1
    figures.tokens_captured += _int(metrics.get("generated_tokens_captured"))
    delivered = _int(metrics.get("generated_tokens_delivered"))
    figures.tokens_delivered += delivered
    fallbacks = metrics.get("faithful_fallbacks")
    if isinstance(fallbacks, Mapping):
        _add(figures.faithful_fallbacks, {str(k): _int(v) for k, v in fallbacks.items()})
    _add(figures.other_metrics, dict.fromkeys(set(metrics) - set(SUMMARY_KEYS), 1))
    if masked:
        listed = metrics.get("mask_reasons")
        groups = {reason_group(str(r)) for r in listed} if isinstance(listed, list) else set()
        reasons.update(groups or {NO_REASON})
        return
    figures.unmasked_rebuilt += 1
    figures.tokens_delivered_unmasked += delivered
    fraction = _float(metrics.get("delivered_fraction"))
    figures.delivered_fraction[fraction_bin(fraction)] += 1
    figures.low_delivery += fraction < LOW_DELIVERY


def reason_group(reason: str) -> str:
    """A mask reason's group: its text before the first ':', call ids and counts stripped.

    ``incomplete capture: call c1: marked incomplete`` -> ``incomplete capture``; a reason about
    one call (``call c1: marked incomplete``) keeps what happened -> ``call: marked incomplete``;
    ``final answer matches 2 captured calls`` -> ``final answer matches N captured calls``;
    ``delivered fraction 0.312 is below min_delivered_fraction 0.5`` -> ``... N ... N``.
    """
    parts = [part.strip() for part in reason.split(":")]
    group = parts[0]
    if re.fullmatch(r"call \S+", group):
        group = f"call: {parts[1]}" if len(parts) > 1 else "call"
    return re.sub(r"\b\d+(?:\.\d+)?\b", "N", group) or NO_REASON


def fraction_bin(fraction: float) -> str:
    """``0.0-0.1`` ... ``0.9-1.0`` (upper bound excluded), and ``1.0`` for all delivered."""
    if fraction >= 1.0:
        return FRACTION_BINS[-1]
    return FRACTION_BINS[min(max(int(fraction * 10), 0), 9)]


def _chain_bin(chains: int) -> str:
    return CHAIN_BINS[min(max(chains, 0), len(CHAIN_BINS) - 1)]


def _add(total: dict[str, int], counts: Mapping[str, int]) -> None:
    for key, count in counts.items():
        total[key] = total.get(key, 0) + count


def _int(value: Any) -> int:
    """A metric as an int; a missing or non-numeric one counts as 0 rather than failing."""
    return int(_float(value))


def _float(value: Any) -> float:
    """A metric as a float; missing, non-numeric, NaN or infinite: 0.0 (JSON allows NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


def warnings_of(figures: Figures) -> list[str]:
    """The checks of a first run, each as a sentence saying what to look at."""
    f, warnings = figures, []
    if not f.rollouts:
        warnings.append("no records: nothing to report")
    if f.never_rebuilt:
        warnings.append(
            f"{f.never_rebuilt} of {f.rollouts} rollouts were never rebuilt (no {METRICS_KEY}): "
            "are the workers running, or did the records carry their own token ids?"
        )
    if f.rebuilt and f.single_call / f.rebuilt > SINGLE_CALL_WARN:
        warnings.append(
            f"{f.single_call} of {f.rebuilt} rebuilt rollouts captured one call: the agentic "
            "path never ran (does the harness send every model call through the capture URL?)"
        )
    if f.rollouts and f.masked / f.rollouts > MASK_RATE_WARN:
        top = next(iter(f.mask_reasons), NO_REASON)
        warnings.append(f"mask rate {f.masked / f.rollouts:.0%}; the commonest reason: {top}")
    if f.build_errors:
        warnings.append(
            f"{f.build_errors} of {f.rebuilt} builds failed: see the error in {METRICS_KEY}"
        )
    if f.unmasked_rebuilt and f.low_delivery / f.unmasked_rebuilt >= LOW_DELIVERY_WARN:
        warnings.append(
            f"{f.low_delivery} of {f.unmasked_rebuilt} unmasked rollouts deliver less than "
            f"{LOW_DELIVERY:.0%} of their generated tokens: see chains per rollout (with "
            "delivery: chain, chains other than the main one are not trained on)"
        )
    return warnings


# -- reading -----------------------------------------------------------------------------


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """One record per line (``-``: stdin); blank lines are skipped."""
    try:
        # stdin is not ours to close; a file is.
        handle = nullcontext(sys.stdin) if path == "-" else open(path, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from exc
    with handle as lines:
        try:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield _json_object(line, f"{path} line {number}")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot read {path}: {exc}") from exc


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(value, dict):
        raise BadInput(f"{where}: a JSON {type(value).__name__}, not a record object")
    return value


def read_stream(
    url: str, stream: str, shards: int = 1, cluster: bool = False
) -> Iterator[dict[str, Any]]:
    """Every result on the stream (each of its shards in turn), oldest first, decoded as
    ``ResultsReader`` decodes them.

    XRANGE reads without a consumer group, so nothing is claimed or acknowledged; results the
    trainer already acknowledged were deleted by it and are not seen. A rollout's results
    are all on one shard, so its latest still wins.
    """
    from transports.redis.clients import RedisOptions, open_sync_client

    client = open_sync_client(RedisOptions(url=url, cluster=cluster))
    try:
        problem = mismatch(stream, client.get(layout_key(stream)), shards, cluster, "report")
        if problem is not None:
            raise BadInput(problem)
        for name in shard_names(stream, shards, tagged=cluster):
            yield from _read_one(client, name)
    finally:
        client.close()


def _read_one(client: Any, stream: str) -> Iterator[dict[str, Any]]:
    start = "-"
    while entries := client.xrange(stream, min=start, count=_STREAM_PAGE):
        for entry_id, fields in entries:
            try:
                yield decode_result(entry_id, fields)
            except Exception as exc:
                raise BadInput(f"{stream} entry {as_text(entry_id)}: {exc}") from exc
        start = "(" + as_text(entries[-1][0])


# -- views -------------------------------------------------------------------------------

Row = tuple[str, int, float | None]  # label, count, share


def sections(f: Figures) -> list[tuple[str, list[Row]]]:
    """The table's rows by section; a share is of the section's own whole, said in its title."""
    rows = [
        ("rollouts", f.rollouts, None),
        ("earlier results replaced", f.replaced_results, None),
        ("never rebuilt (no metrics)", f.never_rebuilt, share(f.never_rebuilt, f.rollouts)),
        ("masked (mask rate)", f.masked, share(f.masked, f.rollouts)),
        ("build errors", f.build_errors, share(f.build_errors, f.rollouts)),
        ("rebuilt", f.rebuilt, share(f.rebuilt, f.rollouts)),
        ("one call (agentic path never ran)", f.single_call, share(f.single_call, f.rebuilt)),
    ]
    found = [
        ("outcome (share of all rollouts; one call: of rebuilt)", rows),
        ("mask rate by reason (share of all rollouts)", _rows(f.mask_reasons, f.rollouts)),
        ("chains per rebuilt rollout", _rows(f.chains, f.rebuilt, "chains ")),
        (
            "delivered fraction of unmasked rebuilt rollouts",
            _rows(f.delivered_fraction, f.unmasked_rebuilt, "delivered "),
        ),
        (
            "generated tokens (share of captured)",
            [
                ("captured", f.tokens_captured, None),
                ("delivered", f.tokens_delivered, share(f.tokens_delivered, f.tokens_captured)),
                (
                    "delivered in unmasked rollouts",
                    f.tokens_delivered_unmasked,
                    share(f.tokens_delivered_unmasked, f.tokens_captured),
                ),
            ],
        ),
        ("faithful fallbacks by reason", _rows(f.faithful_fallbacks, None, "fallback ")),
        ("segments by role", _rows(f.segments_by_role, None, "segments ")),
    ]
    return [(title, section) for title, section in found if section]


def _rows(counts: Mapping[str, int], whole: int | None, label: str = "") -> list[Row]:
    return [
        (label + key, n, share(n, whole) if whole is not None else None)
        for key, n in counts.items()
    ]


def render(figures: Figures, console: Console) -> None:
    table = Table(title="tokcap report", show_header=True)
    table.add_column("figure")
    table.add_column("count", justify="right")
    table.add_column("share", justify="right")
    for title, rows in sections(figures):
        table.add_section()
        table.add_row(Text(title, style="bold"), "", "")
        for label, count, part in rows:
            table.add_row(Text(label), str(count), "-" if part is None else f"{part:.1%}")
    console.print(table)
    if figures.other_metrics:
        names = ", ".join(f"{k} ({n})" for k, n in sorted(figures.other_metrics.items()))
        console.print(Text(f"metric keys this report does not know: {names}"), soft_wrap=True)
    for warning in figures.warnings:
        console.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)


def plot(figures: Figures, path: str) -> None:
    """A PNG of the histograms a first run is judged by; Agg, so no display is needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [
        ("delivered fraction (unmasked rollouts)", "rollouts", figures.delivered_fraction),
        ("chains per rollout", "rollouts", figures.chains),
        ("masked rollouts by reason", "rollouts", figures.mask_reasons or {"none masked": 0}),
        ("outcome", "rollouts", _outcomes(figures)),
    ]
    if figures.segments_by_role:
        panels.append(("segments by role", "segments", figures.segments_by_role))
    if figures.faithful_fallbacks:
        panels.append(("faithful fallbacks by reason", "calls", figures.faithful_fallbacks))
    rows = (len(panels) + 1) // 2
    chart = Figure(figsize=(13, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(chart)
    axes = list(chart.subplots(rows, 2, squeeze=False).flat)
    for ax, panel in zip(axes, panels, strict=False):
        _bars(ax, *panel)
    for ax in axes[len(panels) :]:  # the grid's last cell when the panels are odd
        ax.set_visible(False)
    chart.savefig(path, format="png", dpi=100)


def _outcomes(f: Figures) -> dict[str, int]:
    return {
        "unmasked": f.unmasked_rebuilt,
        "masked": f.masked,
        "one call (rebuilt)": f.single_call,
        "never rebuilt": f.never_rebuilt,
    }


def _bars(ax: Any, title: str, unit: str, counts: Mapping[str, int]) -> None:
    """Horizontal bars: labels such as mask reasons are sentences."""
    from matplotlib.ticker import MaxNLocator

    labels = list(counts)[::-1]
    values = [counts[label] for label in labels]
    ax.barh(range(len(labels)), values, color="tab:blue")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(unit)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for y, value in enumerate(values):
        ax.annotate(
            str(value),
            (value, y),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )


# -- the command -------------------------------------------------------------------------


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
    url = args.url or os.environ.get(URL_ENV)
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
    if args.json:
        print(json.dumps(figures.as_dict()))
    else:
        render(figures, Console())
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("tokcap report", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
