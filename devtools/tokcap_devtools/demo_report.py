"""What ``tokcap demo`` leaves behind: its rebuilt records and ``tokcap report``'s views of
them, in one directory it names at the end.

Why: a first run should see the report a training run is watched by (the trend over its
steps above all), on rollouts it has just watched being made, and be able to run
``tokcap report`` on the same records itself. The views are made from the written
``results.jsonl`` as ``tokcap report`` reads it, so they are what that command shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from capture import json_default
from tokcap.report.drawing import plot
from tokcap.report.reading import read_jsonl
from tokcap.report.steps import report_steps
from tokcap.report.trends import plot_trends, render_report

OUT_DEFAULT = "tokcap-demo-out"
RESULTS = "results.jsonl"  # the rebuilt records, one per line, as the results stream holds them
TABLES = "report.txt"  # tokcap report's tables: a row per step, then all records
FIGURES = "report.json"  # tokcap report --json
HISTOGRAMS = "report.png"  # tokcap report --png
TREND = "trend.png"  # tokcap report --trend-png


def write_report(records: list[dict[str, Any]], out: Path) -> str:
    """Write the records and the report's views of them into ``out``; returns what was
    written and where, as the demo's last words."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    results.write_text("".join(json.dumps(r, default=json_default) + "\n" for r in records))
    report = report_steps(read_jsonl(str(results)))
    with (out / TABLES).open("w", encoding="utf-8") as handle:
        render_report(report, Console(file=handle, width=100))
    (out / FIGURES).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    drawn = f"{TREND} (the trend over {len(report.stepped)} steps), {HISTOGRAMS}, "
    try:
        plot_trends(report, str(out / TREND))
        plot(report.figures, str(out / HISTOGRAMS))
    except ImportError:  # tokcap-devtools asks for tokcap[report]; a bare install may lack it
        drawn = "no PNGs (they need matplotlib: pip install 'tokcap[report]'), "
    return (
        f"report written to {out}/: {drawn}{TABLES}, {FIGURES}, {RESULTS}. Draw it again, "
        f"or for your own results: tokcap report {results} --trend-png {out / TREND}"
    )
