"""capture.step_metrics over one step's real rebuilt records, and logged through TensorBoard.

The records come from the real path: each rollout's calls are put into a file store as the
front end puts them, and ``finalize_rollout_token_capture`` rebuilds the record. Every
expected value is worked out here from what the test put in (the entries, the versions, the
losses) or from the records' own fields, never from the function's internals.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import numpy
import pytest

import capture.metrics
from capture import FileTokenStore, finalize_rollout_token_capture, step_metrics
from capture.delivery import METRICS_KEY
from capture.mask_reasons import MASK_REASON_SLUGS
from capture.metrics import COUNT_KEYS, ROLES
from capture.records import TokenEntry
from capture.routes import Routes
from capture.samples import training_samples
from tests.capture.test_delivery import record_calls, run_record
from tests.capture.test_segments import claude_code_rollout
from tests.support.chains import chain_entries, entry, fresh, full, loop, message
from tests.support.routes import EXPERTS
from tests.support.routes import rollout as routed_rollout

P = "token_capture/"
CURRENT_VERSION = 6
LOST_CALL = "lost001"  # begun, never put: r-lost's capture is incomplete
STATISTICS = (
    "masked_fraction",
    "one_call_fraction",
    "several_chains_fraction",
    "delivered_fraction/mean",
    "delivered_fraction/p10",
    "policy_versions/mean",
    "policy_versions/max",
    "policy_version_lag/mean",
    "policy_version_lag/max",
)


def versioned(calls: list[TokenEntry], versions: list[str]) -> list[TokenEntry]:
    """The calls stamped with the policy version each was dispatched under."""
    return [
        c.model_copy(update={"policy_version": v}) for c, v in zip(calls, versions, strict=True)
    ]


def updated_loop() -> list[TokenEntry]:
    """Three calls under versions 4, 4, 5; the second was cut by the update to 5 after its
    first token and continued on the new weights."""
    calls = versioned(chain_entries(3, prefix="upd", rollout_id="r-upd"), ["4", "4", "5"])
    calls[1].__pydantic_extra__["policy_version_spans"] = [[0, 1, "4"], [1, 2, "5"]]
    return calls


def differing_routes() -> list[TokenEntry]:
    """A routed chain whose first call was routed differently on the prefix it shares."""
    calls = routed_rollout(3, rollout_id="r-routes")
    changed = calls[0].routed_experts.to_numpy().copy()
    changed[0, 0, 0] = (changed[0, 0, 0] + 1) % EXPERTS
    calls[0] = calls[0].model_copy(update={"routed_experts": Routes.from_array(changed)})
    return calls


async def finalized(store: FileTokenStore, record: dict[str, Any], **options: Any) -> dict:
    await finalize_rollout_token_capture(record, store, **options)
    return record


@pytest.fixture
async def step(tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, list[TokenEntry]]]:
    """One step's records, every outcome the metrics tell apart, and the calls behind them."""
    store = FileTokenStore(tmp_path / "captures")
    calls = {
        "r-upd": updated_loop(),
        "r-one": versioned(chain_entries(1, prefix="one", rollout_id="r-one"), ["5"]),
        "r-seg": claude_code_rollout("r-seg"),
        "r-routes": differing_routes(),
        "r-lost": chain_entries(3, prefix="lost", rollout_id="r-lost"),
        "r-unmatched": chain_entries(2, prefix="um", rollout_id="r-unmatched"),
        "r-min": [
            entry("title", fresh(3), fresh(20), text="Title", rollout_id="r-min"),
            *chain_entries(2, prefix="min", rollout_id="r-min"),
        ],
    }
    for rollout_id, entries in calls.items():
        skip = {LOST_CALL} if rollout_id == "r-lost" else set()
        await record_calls(store, entries, skip=skip)
    now = {"_ng_current_policy_version": CURRENT_VERSION}
    records = [
        await finalized(store, run_record("r-upd", "upd says 2", **now)),
        await finalized(store, run_record("r-one", "one says 0", **now)),
        await finalized(store, run_record("r-seg", "resumed says 1"), delivery="segments"),
        await finalized(store, {"_ng_rollout_id": "r-routes", "response": {"output": []}}),
        await finalized(store, run_record("r-lost", "lost says 2")),
        await finalized(store, run_record("r-unmatched", "an answer no call gave")),
        await finalized(store, run_record("r-min", "min says 1"), min_delivered_fraction=0.9),
        await finalized(store, run_record(None, "no rollout id")),  # a record error
        run_record("r-never", "never finalized"),  # never rebuilt
    ]
    await store.close()
    return records, calls


def test_every_key_says_what_the_records_say(step) -> None:
    records, calls = step
    metrics = step_metrics(records)
    rebuilt = [r for r in records if METRICS_KEY in r]
    unmasked = [r for r in rebuilt if not r["mask_sample"]]
    summaries = [r[METRICS_KEY] for r in rebuilt]

    assert metrics[P + "records"] == len(records) == 9
    assert metrics[P + "rebuilt"] == len(rebuilt) == 8
    assert metrics[P + "never_rebuilt"] == 1
    assert metrics[P + "masked"] == sum(bool(r.get("mask_sample")) for r in records) == 4
    assert metrics[P + "masked_fraction"] == 4 / 9
    assert metrics[P + "one_call"] == sum(s["n_calls"] == 1 for s in summaries) == 1
    assert metrics[P + "one_call_fraction"] == 1 / 8
    several = sum(s["chains"] > 1 for s in summaries)
    assert metrics[P + "several_chains"] == several and several >= 2  # r-seg, r-min
    assert metrics[P + "several_chains_fraction"] == several / 8

    # The training samples the records yield, by role: training_samples reads the records.
    roles = Counter(s.role for r in records for s in training_samples(r))
    assert roles == {"main": 4, "title": 1, "compaction_summary": 1, "subagent": 1}
    assert {role: metrics[P + f"segments/{role}"] for role in ROLES} == {
        role: float(roles[role]) for role in ROLES
    }

    # Tokens: what the rollouts sampled (the entries), and the loss positions delivered.
    put = [e for es in calls.values() for e in es if e.model_call_id != LOST_CALL]
    captured = sum(len(e.generation_token_ids) for e in put)
    trained = sum(sum(s.loss_mask) for r in records for s in training_samples(r))
    assert metrics[P + "tokens/captured"] == captured
    assert metrics[P + "tokens/delivered"] == trained
    assert metrics[P + "tokens/lost"] == captured - trained > 0

    fractions = [r[METRICS_KEY]["delivered_fraction"] for r in unmasked]
    assert metrics[P + "delivered_fraction/mean"] == pytest.approx(numpy.mean(fractions))
    assert metrics[P + "delivered_fraction/p10"] == pytest.approx(numpy.percentile(fractions, 10))

    reasons = {slug: metrics[P + f"mask_reason/{slug}"] for slug in MASK_REASON_SLUGS}
    assert {slug: n for slug, n in reasons.items() if n} == {
        "incomplete_capture": 1,  # r-lost: an intent whose entry never came
        "final_answer_unmatched": 1,  # r-unmatched
        "below_min_delivered": 1,  # r-min: the title is most of what it sampled
        "record_error": 1,  # the record naming no rollout
    }

    # Versions: r-upd ran under 4 and 5, r-one under 5; the consumer named 6.
    assert metrics[P + "policy_versions/mean"] == 1.5 and metrics[P + "policy_versions/max"] == 2
    lags = [CURRENT_VERSION - 4, CURRENT_VERSION - 5]
    assert [
        s["policy_version_lag"] for s in summaries if s["policy_version_lag"] is not None
    ] == lags
    assert metrics[P + "policy_version_lag/mean"] == numpy.mean(lags)
    assert metrics[P + "policy_version_lag/max"] == max(lags)
    assert metrics[P + "calls_spanning_update"] == metrics[P + "rollouts_spanning_update"] == 1
    assert metrics[P + "routes_differing_calls"] == metrics[P + "rollouts_routes_differing"] == 1


# Rollouts the real rebuild masks for each other reason: (calls, final answer, options).
Case = tuple[list[TokenEntry], list[Any], dict[str, Any]]


def _nothing(rid: str) -> Case:
    return [], [message("x")], {}


def _no_tokens(rid: str) -> Case:
    return [entry("e0", [1, 2, 3], [], rollout_id=rid)], [], {}


def _two_roots(rid: str) -> Case:
    title = entry("title", fresh(3), [9], rollout_id=rid)
    return [*chain_entries(2, prefix="a", rollout_id=rid), title], [], {}


def _two_answers(rid: str) -> Case:
    first = chain_entries(2, prefix="a", system=[5, 6], rollout_id=rid)
    second = chain_entries(2, prefix="b", system=[7, 8], created_at=10, rollout_id=rid)
    second[-1].output_items = [message("a says 1")]
    return [*first, *second], [message("a says 1")], {}


def _retry(rid: str) -> Case:
    calls = chain_entries(3, rollout_id=rid)
    again = entry("c002-retry", calls[2].prompt_token_ids, fresh(2), text="no", rollout_id=rid)
    return [*calls, again], [], {}


def _twin_parent(rid: str) -> Case:
    calls = chain_entries(2, rollout_id=rid)
    twin = entry("c001-twin", calls[1].prompt_token_ids, calls[1].generation_token_ids)
    twin = twin.model_copy(update={"rollout_id": rid})
    twin.generation_log_probs = [value - 1.0 for value in twin.generation_log_probs]
    child = entry("c002", full(calls[1]) + fresh(1), fresh(2), text="done", rollout_id=rid)
    return [*calls, twin, child], [message("done")], {}


def _first_calls_lost(rid: str) -> Case:
    calls = loop(5, rollout_id=rid)
    return calls[2:], list(calls[-1].output_items), {}


def _two_runs(rid: str) -> Case:
    ours = loop(3, opening="Task 7: list the files in /srv and count them.", rollout_id=rid)
    theirs = loop(3, prefix="other", opening="Task 8: find the largest file.", rollout_id=rid)
    for call in theirs:
        call.created_at += 0.5
    return [*ours, *theirs], list(ours[-1].output_items), {"delivery": "segments"}


def _partial_routes(rid: str) -> Case:
    calls = routed_rollout(2, rollout_id=rid)
    calls[1] = calls[1].model_copy(update={"routed_experts": None})
    return calls, [], {}


def _masked_before(rid: str) -> Case:
    calls = loop(2, rollout_id=rid)  # delivered whole; the record says mask_sample itself
    return calls, list(calls[-1].output_items), {}


REASON_CASES = {
    "nothing_recorded": _nothing,
    "no_generated_tokens": _no_tokens,
    "several_roots": _two_roots,
    "final_answer_ambiguous": _two_answers,
    "unresolved_retry": _retry,
    "ambiguous_parent": _twin_parent,
    "calls_missing": _first_calls_lost,
    "shared_rollout_id": _two_runs,
    "partial_routes": _partial_routes,
    "unstated": _masked_before,
}


class _Unreachable:
    """A source that cannot freeze: finalize's failures other than the record's."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def freeze(self, rollout_id: str) -> Any:
        raise self.exc


@pytest.mark.parametrize("slug", list(REASON_CASES))
async def test_each_reason_the_rebuild_gives_counts_under_its_slug(slug: str, tmp_path) -> None:
    rid = f"r-{slug}"
    calls, answer, options = REASON_CASES[slug](rid)
    record: dict[str, Any] = {"_ng_rollout_id": rid, "response": {"output": answer}}
    if slug == "unstated":  # masked before finalize (say, by the harness's own check)
        record["mask_sample"] = True
    async with FileTokenStore(tmp_path / "captures") as store:
        await record_calls(store, calls)
        await finalize_rollout_token_capture(record, store, **options)
    counted = step_metrics([record])
    assert record["mask_sample"] is True, record[METRICS_KEY]
    assert {k: v for k, v in counted.items() if k.startswith(P + "mask_reason/") and v} == {
        P + f"mask_reason/{slug}": 1.0
    }, record[METRICS_KEY]["mask_reasons"]


@pytest.mark.parametrize(
    ("exc", "slug"),
    [(ConnectionError("refused"), "source_error"), (RuntimeError("x"), "build_error")],
)
async def test_a_failed_finalize_counts_under_its_kind(exc: Exception, slug: str) -> None:
    record: dict[str, Any] = {"_ng_rollout_id": "r-failed", "response": {"output": []}}
    await finalize_rollout_token_capture(record, _Unreachable(exc))
    counted = step_metrics([record])
    assert {k for k, v in counted.items() if k.startswith(P + "mask_reason/") and v} == {
        P + f"mask_reason/{slug}"
    }


def test_every_slug_but_other_has_a_real_reason_above() -> None:
    covered = {
        *REASON_CASES,
        "source_error",
        "build_error",
        # in the step fixture:
        "incomplete_capture",
        "final_answer_unmatched",
        "below_min_delivered",
        "record_error",
    }
    assert covered == set(MASK_REASON_SLUGS) - {"other"}


def test_keys_are_the_documented_set_whatever_the_data(step) -> None:
    """A key never carries a rollout id, a role or a reason out of the data; counts are
    floats and always there."""
    records, _ = step
    odd = copy.deepcopy(records[0])
    odd["mask_sample"] = True
    odd[METRICS_KEY]["mask_reasons"] = ["a reason of a newer build: call c9: 42 things"]
    odd[METRICS_KEY]["segments"] = {"a role of a newer build": 2}
    unmasked_odd = copy.deepcopy(records[2])
    unmasked_odd[METRICS_KEY]["segments"] = {"a role of a newer build": 2}

    metrics = step_metrics([odd, unmasked_odd], prefix="tc.")
    documented = {"tc." + k for k in (*COUNT_KEYS, *STATISTICS)}
    assert set(metrics) == documented
    assert all(type(value) is float for value in metrics.values())
    assert metrics["tc.mask_reason/other"] == 1
    assert metrics["tc.segments/other"] == 2 and metrics["tc.segments/main"] == 1
    assert set(step_metrics(records)) == {P + k for k in (*COUNT_KEYS, *STATISTICS)}


def test_the_module_docstring_names_every_key() -> None:
    doc = capture.metrics.__doc__ or ""
    for name in (*COUNT_KEYS, *STATISTICS):
        if not name.startswith(("segments/", "mask_reason/")):
            assert f"``{name}``" in doc, name
    assert all(f"``{role}``" in doc for role in ROLES)


def test_no_records_count_zero_and_leave_out_every_share() -> None:
    metrics = step_metrics([])
    assert metrics == {P + name: 0.0 for name in COUNT_KEYS}
    assert not any(P + name in metrics for name in STATISTICS)


def test_the_metrics_log_through_tensorboard_and_read_back(step, tmp_path: Path) -> None:
    """Written by tensorboardX's SummaryWriter (torch.utils.tensorboard's API), read back by
    TensorBoard's own event reader: every key one scalar series, at the step logged."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboardX import SummaryWriter

    records, _ = step
    metrics = step_metrics(records)
    writer = SummaryWriter(logdir=str(tmp_path / "tb"))
    for key, value in metrics.items():
        writer.add_scalar(key, value, global_step=7)
    writer.close()

    reader = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={event_accumulator.SCALARS: 0}
    )
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == set(metrics)
    for key, value in metrics.items():
        [event] = reader.Scalars(key)
        assert event.step == 7
        assert event.value == pytest.approx(value, rel=1e-6)  # stored as float32
