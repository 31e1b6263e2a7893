"""How ``tokcap report`` shows its ``Figures``: a table on the console and a PNG of the
histograms a first run is judged by (matplotlib, imported only when a PNG is asked for).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tokcap.report.figures import Figures, share

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
        ("rollouts by policy version", _rows(f.policy_versions, None, "version ")),
        ("rollouts by versions spanned", _rows(f.versions_spanned, None, "spanning ")),
        ("rollouts by policy version lag", _rows(f.policy_version_lag, None, "lag ")),
        ("across weight updates", _update_rows(f)),
    ]
    return [(title, section) for title, section in found if section]


def _update_rows(f: Figures) -> list[Row]:
    """Calls continued on new weights after their engine cut them, where there were any."""
    if not f.calls_spanning_update:
        return []
    rollouts = f.rollouts_spanning_update
    return [
        ("calls continued on new weights", f.calls_spanning_update, None),
        ("rollouts delivering such calls", rollouts, share(rollouts, f.rebuilt)),
    ]


def _rows(counts: Mapping[str, int], whole: int | None, label: str = "") -> list[Row]:
    return [
        (label + key, n, share(n, whole) if whole is not None else None)
        for key, n in counts.items()
    ]


def render(figures: Figures, console: Console, title: str = "tokcap report") -> None:
    table = Table(title=title, show_header=True)
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
    if figures.policy_versions:
        panels.append(("rollouts by policy version", "rollouts", figures.policy_versions))
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
