"""``tokcap demo``, the README's main command, run as a user runs it.

Both paths: Redis with the worker pool (redis-server is installed by CI) and the file store
with an in-process rebuild. The demo's own JSON rows are checked against the rules it
claims: delivered ids equal the engine's sampled ids, faithful serving gives one unmasked
chain, lossy serving is reported (extra chains), never delivered wrong, and a harness that
edits its final answer gets its rollout masked. Its table is checked for what it explains:
why a rollout was masked, and which rollouts delivered less than half of what was sampled.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_demo(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "tokcap.cli", "demo", "--rollouts", "6", "--seed", "7", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("store", ["redis", "file"])
def test_demo_delivers_sampled_ids(store: str) -> None:
    rows = json.loads(run_demo("--json", "--store", store))
    assert len(rows) == 7  # six rollouts, then one whose harness edits its answer
    edited = [row for row in rows if row["edits_answer"]]
    rows = [row for row in rows if not row["edits_answer"]]
    assert all(row["ids_exact"] for row in rows)
    for row in rows:
        metrics = row["metrics"]
        assert metrics is not None, f"{row['rollout_id']} was never rebuilt"
        assert metrics["n_calls"] == row["turns"]
        assert metrics["capture_incomplete"] is False
        if row["serving"] == "faithful":
            assert metrics["chains"] == 1
            assert metrics["delivered_fraction"] == 1.0
            assert row["mask_sample"] is False
            assert row["retokenized_wrong"] == 0
    multi_turn_lossy = [r for r in rows if r["serving"] == "lossy" and r["turns"] > 1]
    assert multi_turn_lossy, "the demo should drive at least one multi-turn lossy rollout"
    for row in multi_turn_lossy:
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
    cells = [line.strip("│").split("│") for line in text.splitlines() if line.startswith("│ demo")]
    return {row[0].strip(): [cell.strip() for cell in row] for row in cells}


def test_demo_table_says_why_a_rollout_was_masked_and_flags_low_delivery() -> None:
    text = run_demo("--store", "file")
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
    assert "most sampled tokens did not reach the trainer" in text
    (edited,) = [row for row in rows.values() if row[1] == "faithful+edit"]
    assert edited[mask] == "yes" and edited[why].startswith("final answer")
