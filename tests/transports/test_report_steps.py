"""``tokcap report`` across training steps, on real rebuilt records read from several files.

Each step's rollouts are put into a file store call by call as the front end puts them and
rebuilt by ``finalize_rollout_token_capture``: a three-call loop run under policy version
``s`` and rebuilt at ``s + s % 3`` (lag ``s % 3``), a one-call rollout, and either a loop
that lost a call (odd steps: masked) or a loop beside a title root (even steps: part
delivered). Every expected value is worked out here from what was put in, and each step's
metrics are checked against ``capture.step_metrics`` of that step's full records.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import matplotlib.text
import pytest

from capture import FileTokenStore, finalize_rollout_token_capture, json_default, step_metrics
from capture.rollout_ids import step_of_rollout_id
from tests.capture.test_delivery import record_calls, run_record
from tests.support.chains import chain_entries, entry, fresh
from tokcap.report.steps import report_steps
from tokcap.report.trends import trend_figure

STEPS = 5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


async def _step(store: FileTokenStore, s: int) -> list[dict[str, Any]]:
    """Step ``s``'s three rollouts, rebuilt."""
    loop_id, one_id, third_id = (f"step{s}.{task}-0" for task in range(3))
    loop = chain_entries(3, prefix=f"a{s}-", rollout_id=loop_id)
    loop = [call.model_copy(update={"policy_version": str(s)}) for call in loop]
    third = chain_entries(2, prefix=f"c{s}-", rollout_id=third_id)
    if s % 2 == 0:  # a title root beside the loop: 20 of 24 generated tokens not delivered
        third.append(entry(f"t{s}", fresh(3), fresh(20), text="Title", rollout_id=third_id))
    await record_calls(store, loop)
    await record_calls(store, chain_entries(1, prefix=f"b{s}-", rollout_id=one_id))
    await record_calls(store, third, skip={f"c{s}-001"} if s % 2 else set())
    records = [
        run_record(loop_id, f"a{s}- says 2", _ng_current_policy_version=s + s % 3),
        run_record(one_id, f"b{s}- says 0"),
        run_record(third_id, f"c{s}- says 1"),
    ]
    for record in records:
        await finalize_rollout_token_capture(record, store)
    return records


@pytest.fixture
async def steps(tmp_path: Path) -> list[list[dict[str, Any]]]:
    store = FileTokenStore(tmp_path / "captures")
    try:
        return [await _step(store, s) for s in range(STEPS)]
    finally:
        await store.close()


def _expected(s: int) -> dict[str, float]:
    """What step ``s`` was made to show."""
    fractions = [1.0, 1.0] + ([4 / 24] if s % 2 == 0 else [])
    return {
        "records": 3,
        "masked_fraction": (s % 2) / 3,
        "one_call_fraction": (1 + s % 2) / 3,  # a loop that lost its second call has one
        "delivered_fraction/mean": sum(fractions) / len(fractions),
        "policy_version_lag/mean": s % 3,
        "policy_version_lag/max": s % 3,
    }


def _files(tmp_path: Path, steps: list[list[dict[str, Any]]]) -> tuple[Path, Path]:
    """Steps 0-2 in one file, 3-4 in another; an early masked result of step 0's loop comes
    first and a record naming no step last, so the later result and the no-step group show."""
    early = copy.deepcopy(steps[0][0])
    early["mask_sample"] = True
    first = [early, *(r for step in steps[:3] for r in step)]
    loose = run_record("loose-0", "no step")  # never rebuilt
    second = [*(r for step in steps[3:] for r in step), loose]
    paths = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, records in zip(paths, (first, second), strict=True):
        path.write_text("".join(json.dumps(r, default=json_default) + "\n" for r in records))
    return paths


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokcap.cli", "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_steps(found: list[dict[str, Any]], steps: list[list[dict[str, Any]]]) -> None:
    """Steps 0.. in order, each with what it was made to show and with the metrics a trainer
    logging ``step_metrics`` of that step's full records gets."""
    assert [step["step"] for step in found[:STEPS]] == list(range(STEPS))
    for s, step in enumerate(found[:STEPS]):
        expected = _expected(s)
        assert {key: step["metrics"][key] for key in expected} == pytest.approx(expected)
        assert step["metrics"] == pytest.approx(step_metrics(steps[s], prefix=""))
        assert step["figures"]["rollouts"] == 3


def test_report_groups_by_the_rollout_ids_step_across_files(tmp_path: Path, steps) -> None:
    a, b = _files(tmp_path, steps)
    trend = tmp_path / "trend.png"
    done = _report(str(a), str(b), "--json", "--trend-png", str(trend))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    _check_steps(report["steps"], steps)
    assert report["steps"][0]["figures"]["replaced_results"] == 1  # the early masked result
    (loose,) = report["steps"][STEPS:]
    assert loose["step"] is None and loose["figures"]["never_rebuilt"] == 1
    assert report["rollouts"] == 3 * STEPS + 1 and report["replaced_results"] == 1
    assert trend.read_bytes().startswith(PNG_SIGNATURE)
    height, width, _ = matplotlib.image.imread(trend).shape
    assert (width, height) == (1200, 750)


def test_report_groups_by_a_field_the_user_names(tmp_path: Path, steps) -> None:
    records = []
    for s, step in enumerate(steps):
        for task, record in enumerate(copy.deepcopy(step)):
            record["_ng_rollout_id"] = f"task{task}-{s}"  # no step in the id
            record["step"] = str(s) if task == 1 else s  # digits read as the number
            records.append(record)
    records[0]["step"] = "warmup"  # a named step comes after the numbered ones
    source = tmp_path / "fields.jsonl"
    source.write_text("".join(json.dumps(r, default=json_default) + "\n" for r in records))
    done = _report(str(source), "--step-field", "step", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["steps"]
    assert [step["step"] for step in found] == [*range(STEPS), "warmup"]
    by_step = [steps[0][1:], *steps[1:], steps[0][:1]]
    for step, records_of_step in zip(found, by_step, strict=True):
        assert step["metrics"] == pytest.approx(step_metrics(records_of_step, prefix=""))


def test_the_table_has_a_row_per_step_then_every_step_together(tmp_path: Path, steps) -> None:
    a, b = _files(tmp_path, steps)
    done = _report(str(a), str(b))
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) == 8 and cells[1].isdigit():
            rows[cells[0]] = cells[1:]
    assert rows["1"] == ["3", "33.3%", "66.7%", "1.00", "1.00", "1.0", "1"]
    assert rows["2"][:4] == ["3", "0.0%", "33.3%", f"{(2 + 4 / 24) / 3:.2f}"]
    assert rows["no step"] == ["1", "0.0%", "-", "-", "-", "-", "-"]
    assert list(rows) == [*map(str, range(STEPS)), "no step"]
    assert "1 of 16 rollouts name no step" in done.stdout
    assert "tokcap report: all 16 rollouts, every step together" in done.stdout


def _drawn_texts(figure: Any) -> list[matplotlib.text.Text]:
    """The texts a draw shows: every visible one, but of an axis's tick labels only those at
    ticks within the axis's view (the locator makes labels beyond it, never drawn)."""
    ticks, shown = set(), []
    for ax in figure.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                for label in (tick.label1, tick.label2):
                    ticks.add(id(label))
                    if low - 1e-9 <= tick.get_loc() <= high + 1e-9:
                        shown.append(label)
    shown += [t for t in figure.findobj(matplotlib.text.Text) if id(t) not in ticks]
    return [t for t in shown if t.get_visible() and t.get_text().strip()]


def _texts_outside(figure: Any) -> list[str]:
    """Every drawn text whose extent leaves the figure, after a draw."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    box = figure.bbox
    outside = []
    for text in _drawn_texts(figure):
        extent = text.get_window_extent(renderer)
        if not (
            box.x0 - 0.5 <= extent.x0
            and extent.x1 <= box.x1 + 0.5
            and box.y0 - 0.5 <= extent.y0
            and extent.y1 <= box.y1 + 0.5
        ):
            outside.append(text.get_text())
    return outside


def _named_steps(steps: list[list[dict[str, Any]]], count: int) -> list[dict[str, Any]]:
    """``count`` steps with long names, each step 0's records over again."""
    records = []
    for n in range(count):
        for record in copy.deepcopy(steps[0]):
            record["_ng_rollout_id"] += f"-{n}"
            record["phase"] = f"curriculum-stage-{n:03d}"
            records.append(record)
    return records


def test_every_label_of_the_trend_lies_within_the_figure(steps) -> None:
    figure = trend_figure(report_steps(r for step in steps for r in step))
    assert _texts_outside(figure) == []
    drawn = [t.get_text() for t in figure.findobj(matplotlib.text.Text)]
    for label in ("masked fraction", "one call (n_calls == 1)", "policy version lag", "step"):
        assert label in drawn
    many = report_steps(r for s in range(200) for r in _renumbered(steps[s % STEPS], s))
    assert len(many.steps) == 200 and _texts_outside(trend_figure(many)) == []
    named = report_steps(_named_steps(steps, 12), step_field="phase")
    assert len(named.steps) == 12 and _texts_outside(trend_figure(named)) == []
    single = trend_figure(report_steps(steps[1]))
    assert _texts_outside(single) == []
    single.axes[0].text(-0.5, 0.5, "off the figure", transform=single.axes[0].transAxes)
    assert _texts_outside(single) == ["off the figure"]  # the check sees a clipped label


def _renumbered(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    moved = copy.deepcopy(records)
    for record in moved:
        record["_ng_rollout_id"] = f"step{step}." + record["_ng_rollout_id"].split(".", 1)[1]
    return moved


def test_a_trend_without_a_lag_says_so_inside_the_figure(steps) -> None:
    unlagged = [r for step in steps for r in step[1:]]  # the loops are what named a lag
    figure = trend_figure(report_steps(unlagged))
    drawn = " ".join(t.get_text() for t in figure.findobj(matplotlib.text.Text))
    assert "no rollout has a lag" in drawn
    assert _texts_outside(figure) == []


def test_bad_input_is_a_message_and_exit_2(tmp_path: Path, steps) -> None:
    a, _ = _files(tmp_path, steps)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(a.read_text().splitlines()[0] + "\n{not json\n")
    failures = {
        "broken.jsonl line 2: not JSON": _report(str(a), str(broken), "--trend-png", "x.png"),
        "no record has a field 'nope'": _report(str(a), "--step-field", "nope"),
        "- (stdin) can be read once": _report("-", "-"),
        "cannot write": _report(str(a), "--trend-png", str(tmp_path / "none" / "t.png")),
    }
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps({"_ng_rollout_id": "r", "step": [1]}) + "\n")
    failures["rollout r: step is [1]; a step is an integer or a name"] = _report(
        str(listed), "--step-field", "step"
    )
    unstepped = tmp_path / "unstepped.jsonl"
    unstepped.write_text(json.dumps(run_record("r-1", "x")) + "\n")
    failures["--trend-png: no record names a step"] = _report(
        str(unstepped), "--trend-png", str(tmp_path / "t.png")
    )
    for message, done in failures.items():
        assert done.returncode == 2, (message, done.stderr)
        assert message in done.stderr and done.stdout == ""
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "t.png").exists()


def test_the_step_a_rollout_id_names() -> None:
    assert step_of_rollout_id("step12.3-0") == 12
    assert step_of_rollout_id("step0.task7-rollout3-a1") == 0
    for unstepped in ("3-0", "step.3-0", "stepx.3-0", "step12", "Step1.3-0", "", None):
        assert step_of_rollout_id(unstepped) is None
