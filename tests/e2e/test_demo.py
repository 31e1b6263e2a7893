"""``tokcap demo``, the README's main command, run as a user runs it.

Both paths: Redis with the worker pool (redis-server is installed by CI) and the file store
with an in-process rebuild. The demo's own JSON rows are checked against the rules it
claims: delivered ids equal the engine's sampled ids, faithful serving gives one unmasked
chain, lossy serving is reported (extra chains), never delivered wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_demo(*args: str) -> list[dict]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokcap.cli",
            "demo",
            "--json",
            "--rollouts",
            "6",
            "--seed",
            "7",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("store", ["redis", "file"])
def test_demo_delivers_sampled_ids(store: str) -> None:
    rows = run_demo("--store", store)
    assert len(rows) == 6
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
