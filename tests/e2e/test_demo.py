"""``tokcap demo``, the README's main command, run as a user runs it.

Both paths: Redis with the worker pool (redis-server is installed by CI) and the file store
with an in-process rebuild. The demo's own JSON rows are checked against the rules it
claims: delivered ids equal the engine's sampled ids, faithful prompts give one unmasked
chain with every sampled token although re-tokenizing gets some wrong, text prompts are
reported (extra chains), never delivered wrong, and a harness that edits its final answer
gets its rollout masked. The rollouts are spread over steps, one policy version behind, and
the report it writes (tables, JSON, the histograms and the trend PNG) is the one
``tokcap report`` makes of the records it writes beside it. Its table is checked for what
it explains: turns and calls, why a rollout was masked, which rollouts delivered less than
half of what was sampled, and the summary line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from capture import step_metrics
from tokcap.report.reading import read_jsonl

STEPS = 3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_demo(out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "tokcap.cli", "demo", "--rollouts", "6", "--seed", "7"),
            *("--steps", str(STEPS), "--out", str(out), *args),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _check_report(out: Path, rows: list[dict[str, Any]]) -> None:
    """The files the demo names: its rebuilt records, and tokcap report's views of them."""
    records = list(read_jsonl(str(out / "results.jsonl")))
    assert [r["_ng_rollout_id"] for r in records] == [row["rollout_id"] for row in rows]
    report = json.loads((out / "report.json").read_text())
    assert report["rollouts"] == len(rows) and report["masked"] == 1
    assert [step["step"] for step in report["steps"]] == list(range(STEPS))
    for step in report["steps"]:
        mine = [r for r in records if r["_ng_rollout_id"].startswith(f"step{step['step']}.")]
        assert step["metrics"] == pytest.approx(step_metrics(mine, prefix=""))
    for png in ("trend.png", "report.png"):
        assert (out / png).read_bytes().startswith(PNG_SIGNATURE)
    tables = (out / "report.txt").read_text()
    assert f"capture health by step ({STEPS} steps, {len(rows)} rollouts)" in tables


@pytest.mark.parametrize("store", ["redis", "file"])
def test_demo_delivers_sampled_ids(store: str, tmp_path: Path) -> None:
    done = run_demo(tmp_path / "out", "--json", "--store", store)
    rows = json.loads(done.stdout)
    assert len(rows) == 7  # six rollouts, then one whose harness edits its answer
    assert [row["step"] for row in rows] == [n * STEPS // 7 for n in range(7)]
    assert all(row["rollout_id"].startswith(f"step{row['step']}.demo") for row in rows)
    _check_report(tmp_path / "out", rows)
    assert "summary: 7 rollouts over 3 steps; masked 1 (14%)" in done.stderr
    edited = [row for row in rows if row["edits_answer"]]
    rows = [row for row in rows if not row["edits_answer"]]
    assert all(row["ids_exact"] for row in rows)
    for row in rows:
        metrics = row["metrics"]
        assert metrics is not None, f"{row['rollout_id']} was never rebuilt"
        assert metrics["n_calls"] == row["turns"]
        assert metrics["capture_incomplete"] is False
        # One step off-policy: step N samples with version N-1 and is rebuilt at N.
        assert metrics["policy_versions"] == [str(max(row["step"] - 1, 0))]
        assert metrics["policy_version_lag"] == min(row["step"], 1)
        if row["serving"] == "faithful":
            assert metrics["chains"] == 1
            assert metrics["delivered_fraction"] == 1.0
            assert row["mask_sample"] is False
    faithful = [r for r in rows if r["serving"] == "faithful"]
    # The engine's non-canonical sampling is what re-tokenizing gets wrong; faithful prompts
    # deliver those ids all the same.
    assert any(row["retokenized_wrong"] > 0 for row in faithful)
    multi_turn_text = [r for r in rows if r["serving"] == "text" and r["turns"] > 1]
    assert multi_turn_text, "the demo should drive at least one multi-turn text rollout"
    for row in multi_turn_text:
        # Non-canonical sampling is what re-tokenization gets wrong, and what splits chains.
        assert row["retokenized_wrong"] > 0
        assert row["metrics"]["chains"] > 1
        assert row["metrics"]["delivered_fraction"] < 1.0
    (masked,) = edited
    assert masked["mask_sample"] is True and masked["ids_exact"] is None  # nothing delivered
    assert any("final answer" in reason for reason in masked["metrics"]["mask_reasons"])
    assert masked["metrics"]["delivered_fraction"] < 0.5


def _table_rows(text: str) -> dict[str, list[str]]:
    """The demo table's rows by rollout id, each as its cells (a wrapped row's first line)."""
    cells = [line.strip("│").split("│") for line in text.splitlines() if line.startswith("│ step")]
    return {row[0].strip(): [cell.strip() for cell in row] for row in cells}


def test_demo_table_says_why_a_rollout_was_masked_and_flags_low_delivery(tmp_path: Path) -> None:
    text = run_demo(tmp_path / "out", "--store", "file").stdout
    rows = _table_rows(text)
    assert len(rows) == 7
    header = next(line for line in text.splitlines() if "why masked" in line)
    columns = [cell.strip() for cell in header.strip("┃").split("┃")]
    delivered, mask, why = (columns.index(n) for n in ("delivered", "mask", "why masked"))
    flagged = []
    for rollout_id, row in rows.items():
        fraction, mark = (row[delivered].split() + [""])[:2]
        assert (mark == "!") == (float(fraction) < 0.5), row
        flagged += [rollout_id] if mark else []
        assert (row[mask] == "yes") == (row[why] != "-"), row
    assert flagged, "the demo should show a rollout that delivered less than half"
    assert {row[1] for row in rows.values()} == {"faithful", "text", "faithful+edit"}
    assert "lossy" not in text  # the README's words: faithful and text prompts
    assert "most sampled tokens did not reach the trainer" in text
    assert "turns: model requests the harness sent" in text and "calls: the calls" in text
    (edited,) = [row for row in rows.values() if row[1] == "faithful+edit"]
    assert edited[mask] == "yes" and edited[why].startswith("final answer")
    flat = " ".join(text.split())  # the console wraps long lines
    assert "summary: 7 rollouts over 3 steps; masked 1 (14%); delivered fraction" in flat
    assert f"report written to {tmp_path / 'out'}/: trend.png (the trend over 3 steps)" in flat
