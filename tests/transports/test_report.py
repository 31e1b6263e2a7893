"""``tokcap report``: the figures of a step's records, from a JSONL file and from the stream.

The records are shaped like the worker's (``RolloutSummary`` metrics), varied so that every
figure the report shows has a count worth checking: masks for several reasons, a record never
rebuilt, one-call rollouts, several chains, low and full delivered fractions, faithful
fallbacks, segments, an unknown metric key and a result replaced by a later one.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import redis.asyncio as aioredis
from redis.cluster import RedisCluster
from rich.console import Console

from capture.delivery import RolloutBuild
from capture.summary import RolloutSummary
from tokcap.commands import report as report_cli
from tokcap.report.drawing import plot, render
from tokcap.report.figures import (
    Figures,
    compute_figures,
    fraction_bin,
    reason_group,
    warnings_of,
)
from transports.rebuild.publish import ResultToPublish, publish_durably
from transports.rebuild.results import encode_result
from transports.redis.keys import shard_names, shard_of, stream_names
from transports.redis.store import RedisTokenStore

SEGMENTS = [
    {"role": role, "calls": [f"c{i}"], "output": [], "metrics": {}}
    for i, role in enumerate(("title", "subagent", "compaction_summary", "subagent"))
]


def record(rollout_id: str, summary: RolloutSummary | None, **extra: Any) -> dict[str, Any]:
    """A finished record; ``summary`` None: never rebuilt."""
    body: dict[str, Any] = {
        "_ng_rollout_id": rollout_id,
        "response": {"output": [{"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5]}]},
        "reward": 1.0,
    }
    if summary is not None:
        body["_ng_token_capture"] = summary.as_dict()
        body["mask_sample"] = bool(summary.mask_reasons)
    return {**body, **extra}


def delivered(n_calls: int, chains: int, captured: int, given: int, **more: Any) -> RolloutSummary:
    return RolloutSummary(
        n_calls=n_calls,
        chains=chains,
        roots=1,
        delivered_fraction=given / captured,
        generated_tokens_captured=captured,
        generated_tokens_delivered=given,
        main_chain_calls=n_calls,
        main_chain_by="final_answer",
        capture_incomplete=False,
        **more,
    )


def masked(chains: int, captured: int, given: int, *reasons: str) -> RolloutSummary:
    return RolloutSummary(
        n_calls=chains + 2,
        chains=chains,
        roots=chains,
        delivered_fraction=given / captured,
        generated_tokens_captured=captured,
        generated_tokens_delivered=given,
        capture_incomplete=reasons[0].startswith("incomplete"),
        mask_reasons=list(reasons),
    )


def step_records() -> list[dict[str, Any]]:
    with_segments = record("r11", delivered(3, 1, 12, 12), _ng_token_segments=SEGMENTS)
    with_segments["_ng_token_capture"]["segments_delivered"] = 4  # a key this report predates
    return [
        *(record(f"r{i}", delivered(1, 1, 10, 10)) for i in range(4)),
        record("r4", delivered(5, 2, 40, 30, faithful_fallbacks={"no_match": 2})),
        record(
            "r5", delivered(4, 3, 100, 30, faithful_fallbacks={"no_match": 1, "bridge_refused": 1})
        ),
        record(
            "r6",
            masked(
                5,
                50,
                0,
                "incomplete capture: call c1: marked incomplete; call c2: intent without entry",
            ),
        ),
        record("r9", delivered(3, 2, 30, 30)),  # replaced by the later r9 below
        record(
            "r7",
            masked(
                2,
                20,
                0,
                "incomplete capture: call c9: marked incomplete",
                "unresolved retry: calls a, b share a prompt and none was extended",
            ),
        ),
        record(
            "r8",
            replace(
                RolloutSummary.of_failure("MalformedRecordError: bad", "record error: bad"),
                capture_incomplete=None,
            ),
        ),
        record("r9", masked(2, 30, 20, "no final answer to choose among 2 roots")),
        record("r10", None),
        with_segments,
    ]


EXPECTED = {
    "rollouts": 12,
    "replaced_results": 1,
    "never_rebuilt": 1,
    "rebuilt": 11,
    "single_call": 4,
    "masked": 4,
    "unmasked_rebuilt": 7,
    "build_errors": 1,
    "mask_reasons": {
        "incomplete capture": 2,
        "unresolved retry": 1,
        "record error": 1,
        "no final answer to choose among N roots": 1,
    },
    "chains": {"0": 1, "1": 5, "2": 3, "3": 1, "4+": 1},
    "low_delivery": 1,
    "tokens_captured": 292,
    "tokens_delivered": 132,
    "tokens_delivered_unmasked": 112,
    "faithful_fallbacks": {"no_match": 3, "bridge_refused": 1},
    "rollouts_with_segments": 1,
    "segments_by_role": {"title": 1, "subagent": 2, "compaction_summary": 1},
    "other_metrics": {"segments_delivered": 1},
}


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _report(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokcap.cli", "report", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _row(table: str, label: str) -> list[str]:
    """The cells after ``label`` on the table's row that starts with it."""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("│┃ ").split("│")]
        if cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in\n{table}")


def test_figures_of_a_step() -> None:
    figures = compute_figures(step_records())
    found = {key: getattr(figures, key) for key in EXPECTED}
    assert found == EXPECTED
    unmasked = {"1.0": 5, "0.7-0.8": 1, "0.3-0.4": 1}
    assert {k: n for k, n in figures.delivered_fraction.items() if n} == unmasked
    as_dict = figures.as_dict()
    assert as_dict["mask_rate"] == 4 / 12 and as_dict["single_call_share"] == 4 / 11
    assert as_dict["mask_rate_by_reason"]["incomplete capture"] == 2 / 12


def test_report_command_prints_the_table_and_draws_the_png(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "results.jsonl", step_records())
    png = tmp_path / "out.png"
    done = _report(str(source), "--png", str(png))
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert _row(table, "rollouts") == ["12", "-"]
    assert _row(table, "earlier results replaced") == ["1", "-"]
    assert _row(table, "never rebuilt (no metrics)") == ["1", "8.3%"]
    assert _row(table, "masked (mask rate)") == ["4", "33.3%"]
    assert _row(table, "one call (agentic path never ran)") == ["4", "36.4%"]
    assert _row(table, "incomplete capture") == ["2", "16.7%"]
    assert _row(table, "no final answer to choose among N roots") == ["1", "8.3%"]
    assert _row(table, "chains 4+") == ["1", "9.1%"]
    assert _row(table, "chains 1") == ["5", "45.5%"]
    assert _row(table, "delivered 1.0") == ["5", "71.4%"]
    assert _row(table, "delivered 0.3-0.4") == ["1", "14.3%"]
    assert _row(table, "delivered 0.9-1.0") == ["0", "0.0%"]
    assert _row(table, "delivered") == ["132", "45.2%"]
    assert _row(table, "fallback no_match") == ["3", "-"]
    assert _row(table, "segments subagent") == ["2", "-"]
    assert "segments_delivered (1)" in table
    assert "warning: 1 of 12 rollouts were never rebuilt" in table
    assert "warning: mask rate 33%" in table
    assert "1 of 7 unmasked rollouts deliver less than 50%" in table
    assert "agentic path never ran (does" not in table  # 4 of 11: not most
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 0 and image.shape[1] > 0


def test_report_command_json_from_stdin(tmp_path: Path) -> None:
    text = "".join(json.dumps(r) + "\n\n" for r in step_records())  # blank lines are skipped
    done = _report("-", "--json", stdin=text)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert {key: figures[key] for key in EXPECTED} == EXPECTED
    assert figures["delivered_fraction"]["1.0"] == 5
    assert figures["mask_rate_by_reason"]["unresolved retry"] == 1 / 12
    assert any("never rebuilt" in warning for warning in figures["warnings"])


def test_bad_input_is_a_message_and_exit_2(tmp_path: Path) -> None:
    missing = _report(str(tmp_path / "nowhere.jsonl"))
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr and "nowhere.jsonl" in missing.stderr
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(record("r0", None)) + "\n{not json\n")
    done = _report(str(broken))
    assert done.returncode == 2 and "broken.jsonl line 2: not JSON" in done.stderr
    for failed in (missing, done):
        assert "Traceback" not in failed.stderr and failed.stdout == ""


@pytest.mark.parametrize(
    ("argv", "stdin", "message"),
    [
        (["-"], "[1, 2]\n", "- line 1: a JSON list, not a record object"),
        (["-"], "\n", "- holds no records"),
        ([], "", "give a FILE (or - for stdin) or --url URL"),
        (["x.jsonl", "--url", "redis://127.0.0.1:1/0"], "", "give a FILE"),
    ],
)
def test_more_bad_input(argv, stdin, message, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert report_cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_png_with_an_odd_number_of_panels(tmp_path: Path) -> None:
    figures = compute_figures([record("s", delivered(2, 1, 9, 9), _ng_token_segments=SEGMENTS)])
    plot(figures, str(tmp_path / "five.png"))  # four panels and the segments: three rows
    plot(compute_figures([record("s", delivered(2, 1, 9, 9))]), str(tmp_path / "four.png"))
    five = matplotlib.image.imread(tmp_path / "five.png").shape
    four = matplotlib.image.imread(tmp_path / "four.png").shape
    assert five[1] == four[1] > 0 and five[0] > four[0] > 0


def test_reason_groups_and_fraction_bins() -> None:
    assert reason_group("incomplete capture: call c1: marked incomplete") == "incomplete capture"
    assert reason_group("call c-7: marked incomplete") == "call: marked incomplete"
    assert reason_group("final answer matches 3 captured calls") == (
        "final answer matches N captured calls"
    )
    assert reason_group("build error: KeyError: 'x'") == "build error"
    below = "delivered fraction 0.312 is below min_delivered_fraction 0.5"
    assert reason_group(below) == "delivered fraction N is below min_delivered_fraction N"
    assert reason_group("") == "(no reason given)"
    assert [fraction_bin(f) for f in (0.0, 0.05, 0.1, 0.3, 0.95, 0.999, 1.0)] == [
        "0.0-0.1",
        "0.0-0.1",
        "0.1-0.2",
        "0.3-0.4",
        "0.9-1.0",
        "0.9-1.0",
        "1.0",
    ]


def test_warnings_a_first_run_should_flag() -> None:
    single = [record(f"s{i}", delivered(1, 1, 10, 10)) for i in range(3)]
    figures = compute_figures([*single, record("m", delivered(6, 2, 60, 60))])
    (warning,) = figures.warnings
    assert "3 of 4 rebuilt rollouts captured one call: the agentic path never ran" in warning
    healthy = compute_figures([record(f"h{i}", delivered(6, 1, 60, 60)) for i in range(10)])
    assert healthy.warnings == []
    assert warnings_of(Figures()) == ["no records: nothing to report"]
    # A masked record with no reason given, and metrics of the wrong type, are still counted.
    odd = record("odd", None, mask_sample=True, _ng_token_capture={"n_calls": "many"})
    nan = record("nan", None, _ng_token_capture={"delivered_fraction": math.nan, "chains": 1e999})
    figures = compute_figures([odd, nan])
    assert figures.mask_reasons == {"(no reason given)": 1} and figures.chains["0"] == 2
    assert figures.delivered_fraction["0.0-0.1"] == 1


async def _publish(redis_url: str, stream: str, body: dict[str, Any], version: int) -> None:
    """Publish one result as the worker does: ``encode_result`` and ``publish_durably``."""
    summary = RolloutSummary(**body["_ng_token_capture"])
    status = "masked" if body.get("mask_sample") else "ok"
    built = RolloutBuild(body["_ng_rollout_id"], status, "snap-1", version, summary)
    fields = encode_result(body, rollout_id=body["_ng_rollout_id"], version=version)
    store = RedisTokenStore(url=redis_url, durability="none")
    try:
        await publish_durably(
            store,
            ResultToPublish(stream, body["_ng_rollout_id"], "job-1", built, fields),
            guard_ttl_s=60,
        )
    finally:
        await store.close()


async def test_report_reads_the_results_stream(redis_url: str, redis_prefix: str, capsys) -> None:
    results = stream_names(redis_prefix).results
    await _publish(redis_url, results, record("a", delivered(1, 1, 10, 10)), 1)
    await _publish(redis_url, results, record("b", delivered(4, 2, 40, 10)), 1)
    # A late loss: version 2 of b's snapshot supersedes the published version 1.
    await _publish(redis_url, results, record("b", masked(2, 40, 0, "incomplete capture")), 2)
    done = await asyncio.to_thread(
        _report, "--url", redis_url, "--key-prefix", redis_prefix, "--json"
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["rollouts"] == 2 and figures["replaced_results"] == 1
    assert figures["masked"] == 1 and figures["mask_reasons"] == {"incomplete capture": 1}
    assert figures["chains"] == {"0": 0, "1": 1, "2": 1, "3": 0, "4+": 0}
    assert report_cli.main(["--url", redis_url, "--stream", results]) == 0
    assert _row(capsys.readouterr().out, "rollouts") == ["2", "-"]
    # XRANGE consumed nothing: every entry is still on the stream, in no consumer group.
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.xlen(results) == 3
        assert await client.xinfo_groups(results) == []
    finally:
        await client.aclose()
    assert report_cli.main(["--url", redis_url, "--stream", results + ":none"]) == 2
    assert "the trainer deletes the results" in capsys.readouterr().err


def test_report_reads_every_shard_of_a_cluster(redis_cluster, redis_prefix: str) -> None:
    """Workers with --cluster --shards 3 publish each result on its rollout's shard."""
    results = stream_names(redis_prefix).results
    names = shard_names(results, 3, tagged=True)
    rollouts = [f"r{index}" for index in range(12)]
    assert {shard_of(rollout, 3) for rollout in rollouts} == {0, 1, 2}  # every shard holds some
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        client.set(f"{results}.layout", "3 cluster")  # as the workers recorded it
        for rollout in rollouts:
            body = record(rollout, delivered(1, 1, 10, 10))
            fields = encode_result(body, rollout_id=rollout, version=1)
            client.xadd(names[shard_of(rollout, 3)], fields)
    finally:
        client.close()
    where = ["--url", redis_cluster.url, "--key-prefix", redis_prefix, "--cluster"]
    done = _report(*where, "--shards", "3", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rollouts"] == 12
    # One shard would read only the first shard's results: the recorded layout says so.
    one = _report(*where, "--json")
    assert one.returncode == 2 and "has 3 shards with cluster names" in one.stderr
    bad = _report(*where, "--shards", "0")
    assert bad.returncode == 2 and "--shards must be within 1..1024" in bad.stderr


def test_the_report_shows_the_policy_versions_rollouts_ran_under(capsys) -> None:
    records = [
        record("a", delivered(2, 1, 20, 20, policy_versions=["4"], policy_version_lag=1)),
        record("b", delivered(3, 1, 30, 30, policy_versions=["4", "5"], policy_version_lag=1)),
        record("c", delivered(2, 1, 20, 20, policy_versions=["5"], policy_version_lag=0)),
        record("d", delivered(1, 1, 10, 10)),  # no versions known: not counted
    ]
    figures = compute_figures(records)
    assert figures.policy_versions == {"4": 2, "5": 2}
    assert figures.versions_spanned == {"1": 2, "2": 1}
    assert figures.policy_version_lag == {"1": 2, "0": 1}
    assert "policy_versions" not in figures.other_metrics
    text = io.StringIO()
    render(figures, Console(file=text, width=120))
    assert "rollouts by policy version" in text.getvalue() and "version 5" in text.getvalue()


def test_the_report_counts_calls_continued_across_a_weight_update(capsys) -> None:
    records = [
        record("a", delivered(2, 1, 20, 20, policy_versions=["4", "5"], calls_spanning_update=2)),
        record("b", delivered(2, 1, 20, 20, policy_versions=["5"], calls_spanning_update=0)),
    ]
    figures = compute_figures(records)
    assert (figures.calls_spanning_update, figures.rollouts_spanning_update) == (2, 1)
    assert "calls_spanning_update" not in figures.other_metrics
    text = io.StringIO()
    render(figures, Console(file=text, width=120))
    assert "across weight updates" in text.getvalue()
    assert "calls continued on new weights" in text.getvalue()
