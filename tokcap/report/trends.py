"""How ``tokcap report`` shows several steps: a table with a row per step before the table of
all records, and a PNG of the trend lines a training run is watched by (matplotlib, imported
only when a PNG is asked for).

Both read each step's ``capture.step_metrics``, so they show what a trainer logging those
metrics plots. A value with nothing to take it over (no unmasked rollout, no lag named) is
shown as ``-`` and left as a gap in its line, never drawn as 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tokcap.report.drawing import render
from tokcap.report.steps import NO_STEP, Step, StepReport

# (header, step_metrics key, how its value reads)
Column = tuple[str, str, Callable[[float], str]]
COLUMNS: tuple[Column, ...] = (
    ("rollouts", "records", lambda v: f"{v:.0f}"),
    ("masked", "masked_fraction", lambda v: f"{v:.1%}"),
    ("one\ncall", "one_call_fraction", lambda v: f"{v:.1%}"),
    ("delivered\nmean", "delivered_fraction/mean", lambda v: f"{v:.2f}"),
    ("delivered\np10", "delivered_fraction/p10", lambda v: f"{v:.2f}"),
    ("lag\nmean", "policy_version_lag/mean", lambda v: f"{v:.1f}"),
    ("lag\nmax", "policy_version_lag/max", lambda v: f"{v:.0f}"),
)
LEGEND = (
    "masked: share of the step's rollouts left out of the loss. one call: share of rebuilt "
    "rollouts with n_calls == 1 (the agentic path never ran). delivered: delivered ÷ captured "
    "tokens of unmasked rollouts, mean and 10th percentile. lag: policy versions the rollouts "
    "ran behind the version named at rebuild. -: nothing to take it over."
)

# (title, y label, [(step_metrics key, line label)], a share in 0..1, what a panel without
# any value is missing)
Panel = tuple[str, str, tuple[tuple[str, str], ...], bool, str]
PANELS: tuple[Panel, ...] = (
    (
        "masked fraction",
        "share of rollouts",
        (("masked_fraction", "masked"),),
        True,
        "no rollouts",
    ),
    (
        "one call (n_calls == 1)",
        "share of rebuilt rollouts",
        (("one_call_fraction", "one call"),),
        True,
        "no rebuilt rollouts",
    ),
    (
        "delivered fraction (unmasked rollouts)",
        "delivered ÷ captured tokens",
        (("delivered_fraction/mean", "mean"), ("delivered_fraction/p10", "p10")),
        True,
        "no unmasked rebuilt rollouts",
    ),
    (
        "policy version lag",
        "versions behind",
        (("policy_version_lag/mean", "mean"), ("policy_version_lag/max", "max")),
        False,
        "no rollout has a lag: name the trainer's version\nat rebuild (current_policy_version)",
    ),
)
_MARKERS_UP_TO = 60  # steps; beyond this the markers would hide the line


def render_report(report: StepReport, console: Console) -> None:
    """One step: its table, as ever. Several: a row per step, then all records' table."""
    if len(report.steps) == 1:
        (step,) = report.steps
        where = "" if step.key is None else f": step {step.key}"
        render(report.figures, console, f"tokcap report{where}")
        return
    render_steps(report, console)
    console.print()
    rollouts = report.figures.rollouts
    render(report.figures, console, f"tokcap report: all {rollouts} rollouts, every step together")


def render_steps(report: StepReport, console: Console) -> None:
    """One row per step; ``no step`` last, where some records name none."""
    rollouts = report.figures.rollouts
    table = Table(
        title=f"capture health by step ({len(report.stepped)} steps, {rollouts} rollouts)"
    )
    table.add_column("step", justify="right", no_wrap=True)
    for header, _, _ in COLUMNS:  # two-line headers, so eight columns fit 80 characters
        table.add_column(header, justify="right", no_wrap=True)
    for step in report.steps:
        cells = [_cell(step.metrics.get(key), shown) for _, key, shown in COLUMNS]
        table.add_row(step.label, *cells)
    console.print(table)
    console.print(Text(LEGEND))
    unplaced = next((s for s in report.steps if s.key is None), None)
    if unplaced is not None:
        console.print(
            Text(
                f"{unplaced.figures.rollouts} of {rollouts} rollouts name no step (no "
                f"step{{N}}. rollout id, or no step field): the '{NO_STEP}' row, left off "
                "the trend",
                style="yellow",
            ),
            soft_wrap=True,
        )


def _cell(value: float | None, shown: Callable[[float], str]) -> str:
    return "-" if value is None else shown(value)


def trend_figure(report: StepReport) -> Any:
    """The trend lines over the steps with a key, four panels sharing the step axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = report.stepped
    chart = Figure(figsize=(12, 7.5), layout="constrained")
    FigureCanvasAgg(chart)
    rollouts = sum(step.figures.rollouts for step in steps)
    chart.suptitle(f"tokcap report: capture health over {len(steps)} steps ({rollouts} rollouts)")
    axes = chart.subplots(2, 2, sharex=True)
    for ax, panel in zip(axes.flat, PANELS, strict=True):
        _panel(ax, steps, *panel)
    for ax in axes[-1]:  # the shared step axis is labelled under the bottom row
        ax.set_xlabel("step")
    return chart


def plot_trends(report: StepReport, path: str) -> None:
    """The trend PNG; Agg, so no display is needed."""
    trend_figure(report).savefig(path, format="png", dpi=100)


def _panel(
    ax: Any,
    steps: list[Step],
    title: str,
    ylabel: str,
    lines: tuple[tuple[str, str], ...],
    share: bool,
    missing: str,
) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    xs = _positions(ax, steps)
    ys_all: list[float] = []
    marker = "o" if len(steps) <= _MARKERS_UP_TO else None
    for (key, label), style in zip(lines, ("-", "--"), strict=False):
        ys = [step.metrics.get(key, math.nan) for step in steps]
        ys_all += ys
        # The second line dashed: where it equals the first, both still show.
        ax.plot(xs, ys, linestyle=style, marker=marker, markersize=4, label=label)
    drawn = any(not math.isnan(y) for y in ys_all)
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if share:
        ax.set_ylim(-0.03, 1.03)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    else:  # room above the highest point for its marker, and at least the ticks 0 and 1
        highest = max([y for y in ys_all if not math.isnan(y)], default=0.0)
        ax.set_ylim(0, max(highest * 1.15, highest + 0.3, 1.2))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if not drawn:
        ax.text(0.5, 0.5, missing, transform=ax.transAxes, ha="center", va="center", fontsize=9)
    elif len(lines) > 1:
        ax.legend(fontsize=9)


def _positions(ax: Any, steps: list[Step]) -> list[int]:
    """Numbered steps at their numbers; with any named step, each step in turn, labelled."""
    from matplotlib.ticker import MaxNLocator

    keys = [step.key for step in steps]
    if all(isinstance(key, int) for key in keys):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return [int(key) for key in keys if isinstance(key, int)]
    ax.set_xticks(range(len(keys)), [str(key) for key in keys], rotation=30, ha="right")
    return list(range(len(keys)))
