"""delivery: segments: every chain delivered once, labelled, contiguous; and the samples.

A Claude-Code-shaped rollout: a title call, the agent loop, a sub-agent (its own system
prompt and tools), an auto-compaction (a summary request extending the loop) and the loop
that resumes from the summary, which ends in the final answer. With the main chain alone
a trainer gets a fraction; with segments it gets every sampled token, each once.
"""

from __future__ import annotations

import pytest

from capture.build.builder import run_builder
from capture.build.segments import SEGMENTS_KEY
from capture.delivery import METRICS_KEY, finalize_rollout_token_capture
from capture.samples import training_samples
from tests.capture.test_delivery import record_calls, run_record
from tests.support.chains import chain_entries, entry, fresh, full, message

MAIN = {"system": "s-main", "tools": "t-main", "n_tools": 5}


def traits(**changes: object) -> dict:
    base = {**MAIN, "structured_output": False, "summary_request": False, "continuation": False}
    return {"request_traits": {**base, **changes}}


def claude_code_rollout(rollout_id: str = "r1") -> list:
    title = entry(
        "title",
        fresh(3),
        fresh(2),
        text="Title",
        created_at=-1.0,
        rollout_id=rollout_id,
        **traits(tools="t-none", n_tools=0, structured_output=True),
    )
    loop = chain_entries(3, prefix="loop", rollout_id=rollout_id)
    for call in loop:
        call.__pydantic_extra__.update(traits())
    sub = chain_entries(2, prefix="sub", system=fresh(4), created_at=0.5, rollout_id=rollout_id)
    for call in sub:
        call.__pydantic_extra__.update(traits(system="s-sub", tools="t-sub"))
    summary = entry(
        "summary",
        full(loop[-1]) + fresh(3),
        fresh(4),
        text="Summary.",
        created_at=10.0,
        rollout_id=rollout_id,
        **traits(summary_request=True),
    )
    resumed = chain_entries(2, prefix="resumed", created_at=20.0, rollout_id=rollout_id)
    for call in resumed:
        call.__pydantic_extra__.update(traits(continuation=True))
    return [title, *loop, *sub, summary, *resumed]


def test_segments_deliver_every_chain_once_with_its_role() -> None:
    calls = claude_code_rollout()
    answer = [message("resumed says 1")]
    chain = run_builder(calls, final_answer=answer)
    assert chain.delivered_fraction < 0.5 and chain.segments == ()
    # Chains carry their roles whatever the delivery (tokcap inspect shows them).
    assert {c.leaf: c.role for c in chain.chains} == {
        "title": "title",
        "summary": "compaction_summary",
        "sub001": "subagent",
        "resumed001": "continuation",
    }
    unanswered = run_builder(calls)  # several roots, no main chain: beside the first root
    assert {c.leaf: c.role for c in unanswered.chains}["sub001"] == "subagent"
    build = run_builder(calls, final_answer=answer, delivery="segments")
    assert build.main_chain == ("resumed000", "resumed001")
    assert build.main_role == "continuation"
    roles = {segment.role: [c.model_call_id for c in segment.calls] for segment in build.segments}
    assert roles == {
        "title": ["title"],
        "compaction_summary": ["loop000", "loop001", "loop002", "summary"],
        "subagent": ["sub000", "sub001"],
    }
    assert build.delivered_fraction == 1.0 and not build.masked
    delivered = [c for s in build.segments for c in s.calls] + list(build.main_entries)
    assert sorted(c.model_call_id for c in delivered) == sorted(c.model_call_id for c in calls)


def test_a_branch_shares_its_first_calls_and_delivers_only_its_own() -> None:
    loop = chain_entries(4)
    branch = entry("branch", full(loop[1]) + fresh(2), fresh(3), text="a branch")
    build = run_builder([*loop, branch], final_answer=[message("c says 3")], delivery="segments")
    (segment,) = build.segments
    assert [c.model_call_id for c in segment.calls] == ["branch"] and segment.role == "other"
    # Contiguous on its own: its prompt carries the shared calls as context.
    (item,) = [i for i in segment.as_dict()["output"] if "generation_token_ids" in i]
    assert item["prompt_token_ids"] == branch.prompt_token_ids
    assert build.delivered_fraction == 1.0


async def test_finalize_attaches_segments_and_training_samples(store) -> None:
    calls = claude_code_rollout("r-seg")
    await record_calls(store, calls)
    record = run_record("r-seg", "resumed says 1")
    built = await finalize_rollout_token_capture(record, store, delivery="segments")
    assert built.ok, built.metrics
    metrics = record[METRICS_KEY]
    assert metrics["delivered_fraction"] == 1.0
    assert metrics["segments"] == {"compaction_summary": 1, "subagent": 1, "title": 1}
    assert [s["role"] for s in record[SEGMENTS_KEY]] == ["title", "compaction_summary", "subagent"]
    samples = training_samples(record)
    assert [s.role for s in samples] == ["main", "title", "compaction_summary", "subagent"]
    by_id = {c.model_call_id: c for c in calls}
    for sample, call_ids in zip(
        samples,
        [["resumed000", "resumed001"], *[s["calls"] for s in record[SEGMENTS_KEY]]],
        strict=True,
    ):
        last = by_id[call_ids[-1]]
        assert sample.input_ids == full(last)  # one sequence, ending in its last call
        assert len(sample.loss_mask) == len(sample.input_ids) == len(sample.log_probs)
        generated = sum(len(by_id[c].generation_token_ids) for c in call_ids)
        assert sum(sample.loss_mask) == generated
        assert [p for p, m in zip(sample.log_probs, sample.loss_mask, strict=True) if m] == [
            lp for c in call_ids for lp in by_id[c].generation_log_probs
        ]


async def test_min_delivered_fraction_masks_and_names_the_fraction(store) -> None:
    title = entry("title", fresh(3), fresh(20), text="Title", created_at=-1, rollout_id="r-min")
    calls = chain_entries(2, rollout_id="r-min")
    await record_calls(store, [title, *calls])
    record = run_record("r-min", "c says 1")
    built = await finalize_rollout_token_capture(record, store, min_delivered_fraction=0.5)
    assert built.masked and record["mask_sample"] is True
    (reason,) = record[METRICS_KEY]["mask_reasons"]
    assert "delivered fraction 0.167 is below min_delivered_fraction 0.5" in reason
    assert training_samples(record) == []


@pytest.mark.parametrize("delivery", ["chain", "segments"])
def test_an_unresolved_retry_masks_whatever_the_delivery(delivery: str) -> None:
    loop = chain_entries(3)
    retry = entry("c002-retry", loop[2].prompt_token_ids, fresh(2), text="neither")
    build = run_builder([*loop, retry], final_answer=[message("other")], delivery=delivery)
    assert build.masked


def test_a_record_that_carried_its_own_ids_is_one_sample() -> None:
    item = {
        "type": "message",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.25],
    }
    record = {"_ng_rollout_id": "own", "response": {"output": [item]}}
    (sample,) = training_samples(record)
    assert (sample.input_ids, sample.loss_mask, sample.log_probs) == (
        [1, 2, 3],
        [0, 0, 1],
        [0.0, 0.0, -0.25],
    )
    assert training_samples({**record, "mask_sample": True}) == []
    assert training_samples({"_ng_rollout_id": "x", "response": {"output": []}}) == []
