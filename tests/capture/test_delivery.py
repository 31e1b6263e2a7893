"""Finalize, retire and the mask guard, through every real store."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from capture.build.projection import flat_ids_and_mask
from capture.delivery import (
    METRICS_KEY,
    MalformedRecordError,
    MaskFractionExceeded,
    MaskFractionGuard,
    check_record,
    finalize_rollout_token_capture,
    retire_rollout_token_capture,
)
from capture.errors import RolloutFrozenError, SchemaVersionError
from capture.records import TokenCaptureSnapshot
from capture.summary import SUMMARY_KEYS
from tests.support.chains import chain_entries, entry, fresh, full, message
from tests.support.contiguity import is_contiguous

METRIC_KEYS = {
    "n_calls",
    "chains",
    "roots",
    "quarantined_calls",
    "quarantined_fraction",
    "delivered_fraction",
    "generated_tokens_captured",
    "generated_tokens_delivered",
    "empty_generation_calls",
    "capture_incomplete",
    "error",
}


def run_record(rollout_id: str | None, answer: str, **extra: Any) -> dict[str, Any]:
    """A finished harness run as a Gym collector holds it: text only, no token ids."""
    record: dict[str, Any] = {
        "reward": 1.0,
        "response": {
            "id": "resp_1",
            "model": "policy",
            "output": [message(answer)],
            "usage": {"input_tokens": 10, "output_tokens": 5},
        },
        **extra,
    }
    if rollout_id is not None:
        record["_ng_rollout_id"] = rollout_id
    return record


async def record_calls(store: Any, entries: list, *, skip: set[str] = frozenset()) -> None:
    """What the model server does per call: an intent, then the entry (unless lost)."""
    for call in entries:
        await store.begin_call(call.rollout_id, call.model_call_id)
        if call.model_call_id not in skip:
            await store.put(call)


async def test_finalize_replaces_only_the_output_and_attaches_metrics(store):
    calls = chain_entries(4, rollout_id="r-ok")
    await record_calls(store, calls)
    record = run_record("r-ok", "c says 3", extra_field={"kept": True})
    untouched = {k: copy.deepcopy(v) for k, v in record.items() if k != "response"}
    response_rest = {k: v for k, v in record["response"].items() if k != "output"}

    built = await finalize_rollout_token_capture(record, store)

    assert built.ok and not built.masked and built.error is None
    assert built.snapshot_id and built.version > 0
    assert record["mask_sample"] is False
    assert {k: record[k] for k in untouched} == untouched
    assert {k: v for k, v in record["response"].items() if k != "output"} == response_rest
    output = record["response"]["output"]
    assert len(output) == 4 and is_contiguous(output)
    ids, mask = flat_ids_and_mask(output)
    assert ids == full(calls[-1]) and sum(mask) == 8
    metrics = record[METRICS_KEY]
    assert METRIC_KEYS <= set(metrics)
    assert metrics["n_calls"] == 4 and metrics["chains"] == 1 and metrics["roots"] == 1
    assert metrics["delivered_fraction"] == 1.0 and metrics["capture_incomplete"] is False
    assert metrics["error"] is None and built.metrics == metrics


async def test_retire_drops_exactly_the_built_snapshot(store):
    calls = chain_entries(2, rollout_id="r-retire")
    await record_calls(store, calls)
    built = await finalize_rollout_token_capture(run_record("r-retire", "c says 1"), store)
    assert await retire_rollout_token_capture("r-retire", store, built) is True
    assert (await store.inspect("r-retire"))["state"] == "retired"
    with pytest.raises(RolloutFrozenError):
        await store.put(entry("late", [1], [2], rollout_id="r-retire"))
    assert await retire_rollout_token_capture("r-retire", store, built) is True
    assert await retire_rollout_token_capture("other-rollout", store, built) is False


async def test_retire_fails_when_the_version_advanced_after_the_build(store):
    calls = chain_entries(2, rollout_id="r-race")
    await record_calls(store, calls)
    built = await finalize_rollout_token_capture(run_record("r-race", "c says 1"), store)
    assert built.ok
    await store.mark_incomplete("r-race", "c-lost")  # a late loss report
    assert await retire_rollout_token_capture("r-race", store, built) is False
    assert (await store.inspect("r-race"))["state"] == "frozen"


async def test_a_lost_call_masks_and_the_masked_build_is_never_retired(store):
    calls = chain_entries(3, rollout_id="r-lost")
    await record_calls(store, calls, skip={"c001"})
    record = run_record("r-lost", "c says 2")
    original_output = copy.deepcopy(record["response"]["output"])
    built = await finalize_rollout_token_capture(record, store)
    assert built.masked and not built.ok
    assert record["mask_sample"] is True
    assert record[METRICS_KEY]["capture_incomplete"] is True
    assert record["response"]["output"] == original_output  # a masked record keeps its text
    assert await retire_rollout_token_capture("r-lost", store, built) is False
    assert (await store.inspect("r-lost"))["state"] == "frozen"
    again = await finalize_rollout_token_capture(run_record("r-lost", "c says 2"), store)
    assert (again.snapshot_id, again.version) == (built.snapshot_id, built.version)


async def test_a_lost_call_reported_by_the_server_masks(store):
    calls = chain_entries(2, rollout_id="r-mark")
    await record_calls(store, calls)
    await store.mark_incomplete("r-mark", "c-dropped")
    record = run_record("r-mark", "c says 1")
    assert (await finalize_rollout_token_capture(record, store)).masked
    assert record["mask_sample"] is True


async def test_a_voided_call_is_not_a_loss(store):
    calls = chain_entries(2, rollout_id="r-void")
    await record_calls(store, calls)
    await store.begin_call("r-void", "c-cancelled")
    await store.void_call("r-void", "c-cancelled")
    built = await finalize_rollout_token_capture(run_record("r-void", "c says 1"), store)
    assert built.ok


async def test_nothing_recorded_masks(store):
    record = run_record("r-empty", "hello")
    built = await finalize_rollout_token_capture(record, store)
    assert built.masked and record["mask_sample"] is True
    assert record[METRICS_KEY]["n_calls"] == 0
    assert any("nothing recorded" in r for r in record[METRICS_KEY]["mask_reasons"])
    # Freezing the unknown rollout still blocks a late writer.
    with pytest.raises(RolloutFrozenError):
        await store.put(entry("late", [1], [2], rollout_id="r-empty"))


async def test_unresolved_retry_and_ambiguous_delivered_parent_mask(store):
    calls = chain_entries(3, rollout_id="r-retry")
    retry = entry("c002-x", calls[2].prompt_token_ids, fresh(2), rollout_id="r-retry")
    await record_calls(store, [*calls, retry])
    record = run_record("r-retry", "an answer neither call gave")
    assert (await finalize_rollout_token_capture(record, store)).masked
    assert record[METRICS_KEY]["unresolved_retries"] == 1

    calls = chain_entries(2, rollout_id="r-twin")
    twin = entry(
        "twin", calls[1].prompt_token_ids, calls[1].generation_token_ids, rollout_id="r-twin"
    )
    twin.generation_log_probs = [v - 1.0 for v in twin.generation_log_probs]  # another sample
    child = entry("c002", full(calls[1]) + fresh(1), fresh(1), text="end", rollout_id="r-twin")
    await record_calls(store, [*calls, twin, child])
    record = run_record("r-twin", "end")
    assert (await finalize_rollout_token_capture(record, store)).masked
    assert record[METRICS_KEY]["quarantined_calls"] == 1


async def test_a_title_call_is_reported_not_masked(store):
    title = entry("title", [50, 51], [52], text="Title", created_at=-1, rollout_id="r-title")
    calls = chain_entries(3, rollout_id="r-title")
    await record_calls(store, [title, *calls])
    record = run_record("r-title", "c says 2")
    built = await finalize_rollout_token_capture(record, store)
    assert built.ok and record["mask_sample"] is False
    metrics = record[METRICS_KEY]
    assert metrics["chains"] == 2 and metrics["roots"] == 2
    assert metrics["delivered_fraction"] == pytest.approx(6 / 7)
    assert len(record["response"]["output"]) == 3


async def test_malformed_or_missing_rollout_id_masks_without_touching_the_source(store):
    for record in (run_record("../escape", "x"), run_record(None, "x")):
        built = await finalize_rollout_token_capture(record, store)
        assert built.masked and built.error and record["mask_sample"] is True
        assert record[METRICS_KEY]["error"] == built.error
    bad = run_record(None, "x", _ng_task_index=-1, _ng_rollout_index=0)
    assert (await finalize_rollout_token_capture(bad, store)).masked
    bad_arg = run_record("fine-id", "x")
    built = await finalize_rollout_token_capture(bad_arg, store, rollout_id="has space")
    assert built.masked and "InvalidRolloutIdError" in built.error
    assert (await store.inspect("fine-id"))["state"] == "absent"


async def test_rollout_id_from_indices_and_the_explicit_argument(store):
    calls = chain_entries(2, rollout_id="7-3-a1")
    await record_calls(store, calls)
    record = run_record(
        None, "c says 1", _ng_task_index=7, _ng_rollout_index=3, _ng_attempt_index=1
    )
    built = await finalize_rollout_token_capture(record, store)
    assert built.ok and built.rollout_id == "7-3-a1"

    other = chain_entries(2, rollout_id="explicit")
    await record_calls(store, other)
    record = run_record("ignored-id", "c says 1")
    built = await finalize_rollout_token_capture(record, store, rollout_id="explicit")
    assert built.ok and built.rollout_id == "explicit"
    assert (await store.inspect("ignored-id"))["state"] == "absent"


async def test_a_record_that_already_carries_token_ids_is_left_alone(store):
    calls = chain_entries(2, rollout_id="r-done")
    await record_calls(store, calls)
    record = run_record("r-done", "c says 1")
    item = record["response"]["output"][0]
    item.update(prompt_token_ids=[1, 2], generation_token_ids=[3], generation_log_probs=[-0.1])
    before = copy.deepcopy(record)
    built = await finalize_rollout_token_capture(record, store)
    assert built.skipped and not built.ok and not built.masked
    assert record == before
    assert (await store.inspect("r-done"))["state"] == "open"  # not frozen
    assert await retire_rollout_token_capture("r-done", store, built) is False


async def test_finalize_twice_leaves_a_delivered_record_alone(store):
    calls = chain_entries(2, rollout_id="r-twice")
    await record_calls(store, calls)
    record = run_record("r-twice", "c says 1")
    assert (await finalize_rollout_token_capture(record, store)).ok
    delivered = copy.deepcopy(record)
    assert (await finalize_rollout_token_capture(record, store)).skipped
    assert record == delivered


async def test_a_record_already_masked_stays_masked(store):
    calls = chain_entries(2, rollout_id="r-premasked")
    await record_calls(store, calls)
    record = run_record("r-premasked", "c says 1", mask_sample=True)
    built = await finalize_rollout_token_capture(record, store)
    assert built.ok and record["mask_sample"] is True


async def test_a_record_without_a_response_object_masks(store):
    calls = chain_entries(1, rollout_id="r-noresp")
    await record_calls(store, calls)
    record = {"_ng_rollout_id": "r-noresp", "reward": 0.0}
    built = await finalize_rollout_token_capture(record, store)
    assert built.masked and "no response" in built.error
    assert "response" not in record and record["mask_sample"] is True


class RaisingSource:
    """A source whose every call fails, as an unreachable Redis would."""

    def __init__(self) -> None:
        self.drops = 0

    async def freeze(self, rollout_id: str) -> Any:
        raise ConnectionError("connection refused")

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        self.drops += 1
        raise ConnectionError("connection refused")

    async def close(self) -> None:
        return None


async def test_finalize_never_raises():
    source = RaisingSource()
    record = run_record("r-down", "x")
    built = await finalize_rollout_token_capture(record, source)
    assert built.masked and "ConnectionError" in built.error and built.error_kind == "source"
    assert record["mask_sample"] is True and record[METRICS_KEY]["capture_incomplete"] is None
    assert await retire_rollout_token_capture("r-down", source, built) is False
    assert source.drops == 0
    for odd_record, odd_source in (
        ("not a record", source),
        (None, source),
        (run_record("r", "x"), object()),
    ):
        built = await finalize_rollout_token_capture(odd_record, odd_source)
        assert built.masked and built.error


def test_check_record_names_what_keeps_a_record_from_a_rebuild():
    good = run_record("r-shape", "x")
    assert check_record(good) is good["response"]["output"]
    assert check_record({"response": {"output": []}}) == []  # the rollout id is checked apart
    bad = {
        "a string": ("not a record", "mutable mapping, got str"),
        "a list": ([{"response": {}}], "mutable mapping, got list"),
        "no response": ({"_ng_rollout_id": "r"}, "no response object to rebuild (NoneType)"),
        "response text": ({"response": "done"}, "no response object to rebuild (str)"),
        "output text": ({"response": {"output": "done"}}, "output must be a list, got str"),
        "no output": ({"response": {"id": "resp_1"}}, "output must be a list, got NoneType"),
        "output object": ({"response": {"output": {}}}, "output must be a list, got dict"),
    }
    for name, (record, message_part) in bad.items():
        with pytest.raises(MalformedRecordError, match=re.escape(message_part)):
            check_record(record)
        assert isinstance(check_record(run_record(name, "x")), list)


MALFORMED_RECORDS = {
    "response text": lambda rid: {"_ng_rollout_id": rid, "response": "done"},
    "output text": lambda rid: {"_ng_rollout_id": rid, "response": {"output": "done"}},
    "output missing": lambda rid: {"_ng_rollout_id": rid, "response": {"id": "resp_1"}},
    "no rollout id": lambda rid: {"response": {"output": [message("c says 1")]}},
    "invalid rollout id": lambda rid: run_record(rid + " x", "c says 1"),
}


@pytest.mark.parametrize("shape", list(MALFORMED_RECORDS))
async def test_a_malformed_record_is_a_record_error_and_freezes_nothing(store, shape):
    calls = chain_entries(2, rollout_id="r-poison")
    await record_calls(store, calls)
    record = MALFORMED_RECORDS[shape]("r-poison")
    built = await finalize_rollout_token_capture(record, store)
    assert built.error_kind == "record" and built.error
    assert built.masked and not built.ok and not built.snapshot_id and built.version == 0
    assert record["mask_sample"] is True and record[METRICS_KEY]["error"] == built.error
    assert await retire_rollout_token_capture("r-poison", store, built) is False
    # Nothing was frozen: the rollout still takes writes, and a valid record gets the build.
    assert (await store.inspect("r-poison"))["state"] == "open"
    await store.put(entry("late", full(calls[-1]), fresh(2), rollout_id="r-poison"))
    valid = run_record("r-poison", "late")
    rebuilt = await finalize_rollout_token_capture(valid, store)
    assert rebuilt.ok and rebuilt.error_kind is None and valid["mask_sample"] is False


class BrokenSnapshotSource:
    """A reachable source whose freeze fails for a reason retrying does not cure."""

    def __init__(self, error: Exception | None = None, snapshot: Any = None) -> None:
        self.error = error
        self.snapshot = snapshot

    async def freeze(self, rollout_id: str) -> Any:
        if self.error is not None:
            raise self.error
        return self.snapshot


async def test_error_kind_tells_the_source_from_the_build(store):
    calls = chain_entries(2, rollout_id="r-kind")
    await record_calls(store, calls)
    built = await finalize_rollout_token_capture(run_record("r-kind", "c says 1"), store)
    assert built.ok and built.error is None and built.error_kind is None
    lossy = chain_entries(2, rollout_id="r-kind-lossy")
    await record_calls(store, lossy, skip={lossy[0].model_call_id})
    masked = await finalize_rollout_token_capture(run_record("r-kind-lossy", "c says 1"), store)
    assert masked.masked and masked.error is None and masked.error_kind is None  # not an error

    for unreachable in (ConnectionError("refused"), TimeoutError("slow"), OSError("reset")):
        down = await finalize_rollout_token_capture(
            run_record("r-down", "x"), BrokenSnapshotSource(unreachable)
        )
        assert down.error_kind == "source" and type(unreachable).__name__ in down.error
    newer = SchemaVersionError("written by a newer tokcap")
    refused = await finalize_rollout_token_capture(
        run_record("r-new", "x"), BrokenSnapshotSource(newer)
    )
    assert refused.error_kind == "build" and "newer tokcap" in refused.error
    stranger = TokenCaptureSnapshot(rollout_id="someone-else", entries=(), snapshot_id="s")
    wrong = await finalize_rollout_token_capture(
        run_record("r-wrong", "x"), BrokenSnapshotSource(snapshot=stranger)
    )
    assert wrong.error_kind == "build" and "someone-else" in wrong.error


def test_mask_fraction_guard_waits_for_min_samples_then_raises():
    guard = MaskFractionGuard(max_fraction=0.25, min_samples=4)
    guard.observe(True)
    guard.observe(True)  # 100% masked, but too few samples to judge
    guard.observe(False)
    with pytest.raises(MaskFractionExceeded, match=r"3 of 4 rollouts were masked"):
        guard.observe(True)
    ok = MaskFractionGuard(max_fraction=0.5, min_samples=2)
    for masked in (True, False, False, True):
        ok.observe(masked)
    assert ok.fraction == 0.5
    off = MaskFractionGuard(max_fraction=None, min_samples=1)
    for _ in range(5):
        off.observe_record({"mask_sample": True})
    assert off.masked == 5
    records = MaskFractionGuard(max_fraction=0.0, min_samples=1)
    records.observe_record({"reward": 1.0})
    with pytest.raises(MaskFractionExceeded):
        records.observe_record({"mask_sample": True})
    with pytest.raises(ValueError):
        MaskFractionGuard(max_fraction=1.5)
    with pytest.raises(ValueError):
        MaskFractionGuard(max_fraction=0.1, min_samples=0)


async def test_every_outcome_carries_every_summary_key(store):
    """Delivered, masked and failed builds feed a dashboard the same keys."""
    calls = chain_entries(2, rollout_id="r-keys")
    await record_calls(store, calls)
    delivered = run_record("r-keys", "c says 1")
    await finalize_rollout_token_capture(delivered, store)
    masked = run_record("r-keys-none", "nothing was captured")
    await finalize_rollout_token_capture(masked, store)

    class Unreachable:
        async def freeze(self, rollout_id):
            raise ConnectionError("store unreachable")

    failed = run_record("r-keys-down", "x")
    built = await finalize_rollout_token_capture(failed, Unreachable())
    assert built.status == "failed" and built.transient and built.masked
    assert delivered["mask_sample"] is False and masked["mask_sample"] is True
    for record in (delivered, masked, failed):
        assert tuple(record[METRICS_KEY]) == SUMMARY_KEYS
    assert failed[METRICS_KEY]["error"].startswith("SourceUnavailableError")
    assert failed[METRICS_KEY]["capture_incomplete"] is None
