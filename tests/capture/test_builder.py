"""The rebuild (prefix merging) and its projection onto Responses items, rule by rule."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from capture.build.builder import run_builder
from capture.build.projection import flat_ids_and_mask
from capture.errors import ConflictingEntryError
from capture.records import TokenCaptureSnapshot, TokenEntry
from capture.summary import RolloutSummary
from tests.support.chains import SYSTEM, chain_entries, entry, fresh, full, message
from tests.support.contiguity import contiguity_errors, is_contiguous


def summary_of(build) -> RolloutSummary:
    return RolloutSummary.of_build(build, capture_incomplete=False, mask_reasons=[])


def test_linear_chain_links_each_call_to_the_previous_one():
    calls = chain_entries(5)
    build = run_builder(calls)
    assert build.parents == {
        "c000": None,
        "c001": "c000",
        "c002": "c001",
        "c003": "c002",
        "c004": "c003",
    }
    assert build.main_chain == tuple(e.model_call_id for e in calls)
    assert build.main_chain_by == "only_root"
    assert len(build.chains) == 1 and build.chains[0].main
    assert build.roots == ("c000",)
    assert not build.masked
    assert build.delivered_fraction == 1.0
    assert build.generated_tokens_delivered == build.generated_tokens_captured == 10


def test_arrival_order_does_not_change_the_build():
    calls = chain_entries(6) + chain_entries(2, prefix="t", system=[90, 91], created_at=100)
    forward = run_builder(calls)
    assert run_builder(calls[::-1]) == forward
    assert run_builder(calls[3:] + calls[:3]) == forward


def test_parent_is_the_longest_prefix_not_just_any_prefix():
    calls = chain_entries(3)
    # A fork: continues c001 with a different tool output than c002 saw.
    fork = entry("fork", full(calls[1]) + fresh(2), fresh(2), created_at=9)
    build = run_builder([*calls, fork])
    assert build.parents["fork"] == "c001"
    assert len(build.chains) == 2
    assert {chain.leaf for chain in build.chains} == {"c002", "fork"}


def test_calls_without_generated_tokens_are_set_aside_and_counted():
    calls = chain_entries(3)
    empty = entry("empty", full(calls[0]) + fresh(1), [], items=[])
    build = run_builder([*calls, empty])
    assert build.empty_generation == ("empty",)
    assert "empty" not in build.parents
    assert summary_of(build).empty_generation_calls == 1
    assert build.n_calls == 4
    assert not build.masked
    assert build.main_chain == ("c000", "c001", "c002")


def test_a_retry_that_a_later_call_extended_is_kept_and_its_sibling_discarded():
    calls = chain_entries(4)
    # The harness retried c001: same prompt, another generation, never continued.
    retry = entry("c001-retry", calls[1].prompt_token_ids, fresh(3), created_at=1.5)
    build = run_builder([*calls, retry])
    assert build.discarded_retries == ("c001-retry",)
    assert build.unresolved_retries == ()
    assert build.main_chain == ("c000", "c001", "c002", "c003")
    assert len(build.chains) == 1
    assert not build.masked
    assert build.generated_tokens_captured == 11
    assert build.delivered_fraction == pytest.approx(8 / 11)


def test_a_retry_that_nobody_extended_is_unresolved_and_masks():
    calls = chain_entries(3)
    retry = entry("c002-retry", calls[2].prompt_token_ids, fresh(2), text="c says 2")
    build = run_builder([*calls, retry])
    assert build.unresolved_retries == (("c002", "c002-retry"),)
    assert build.masked
    assert any("unresolved retry" in reason for reason in build.mask_reasons)
    assert len(build.chains) == 2


def test_two_identical_candidate_parents_quarantine_the_child_and_mask_the_delivered_chain():
    calls = chain_entries(2)
    twin = entry("c001-twin", calls[1].prompt_token_ids, calls[1].generation_token_ids)
    # The same ids with other log-probs: not the same sample, so the child is ambiguous.
    twin.generation_log_probs = [value - 1.0 for value in twin.generation_log_probs]
    child = entry("c002", full(calls[1]) + fresh(1), fresh(2), text="done")
    build = run_builder([*calls, twin, child], final_answer=[message("done")])
    assert build.quarantined == ("c002",)
    assert build.main_chain[-1] == "c002"
    assert build.chains[0].quarantined
    assert build.masked
    assert any("ambiguous parent" in reason for reason in build.mask_reasons)
    assert summary_of(build).quarantined_calls == 1
    assert build.quarantined_fraction == pytest.approx(1 / 4)


def test_an_ambiguous_call_off_the_delivered_chain_is_reported_not_masked():
    calls = chain_entries(3)
    title = entry("title-a", [70, 71], [72], text="Title")
    title_twin = entry("title-b", [70, 71], [72], text="Title")
    title_twin.generation_log_probs = [-3.0]  # the same id, another sample
    title_next = entry("title-c", [70, 71, 72, 73], [74], text="Title 2")
    build = run_builder([*calls, title, title_twin, title_next], final_answer=[message("c says 2")])
    assert build.main_chain == ("c000", "c001", "c002")
    assert build.quarantined == ("title-c",)
    assert not build.masked


def test_a_title_call_is_an_extra_root_reported_but_not_masked():
    title = entry("title", [50, 51, 52], [53, 54], text="Fix the bug", created_at=-1.0)
    calls = chain_entries(4)
    build = run_builder([title, *calls], final_answer=[message("c says 3")])
    assert build.main_chain == ("c000", "c001", "c002", "c003")
    assert build.main_chain_by == "final_answer"
    assert len(build.chains) == 2 and set(build.roots) == {"title", "c000"}
    assert build.delivered_fraction < 1.0
    assert not build.masked
    assert [chain.leaf for chain in build.chains if not chain.main] == ["title"]


def test_without_a_final_answer_only_a_single_root_is_delivered():
    calls = chain_entries(3)
    build = run_builder(calls)
    assert (build.main_chain_by, build.main_chain) == ("only_root", ("c000", "c001", "c002"))
    assert not build.masked
    # A title call (or a stranger's call to the rollout) is a second root: which chain is
    # the rollout cannot be told without the final answer, whatever arrived first.
    for created_at in (-5.0, 100.0):
        title = entry("title", [50, 51, 52], [53, 54], text="Fix the bug", created_at=created_at)
        build = run_builder([title, *calls])
        assert build.masked and build.main_chain == ()
        assert build.mask_reasons == ("no final answer to choose among 2 roots",)
        assert build.generated_tokens_delivered == 0 and build.output == ()


def test_a_compaction_summary_chain_is_reported_and_the_answer_chain_delivered():
    before = chain_entries(4)
    summary = entry(
        "compact", full(before[-1]) + fresh(2), fresh(5), text="Summary of work", created_at=4
    )
    after = chain_entries(3, prefix="d", system=[*SYSTEM, 99, 98], created_at=5)
    build = run_builder([*before, summary, *after], final_answer=[message("d says 2")])
    assert build.main_chain == ("d000", "d001", "d002")
    assert build.main_chain_by == "final_answer"
    assert len(build.chains) == 2 and len(build.roots) == 2
    side = [chain for chain in build.chains if not chain.main]
    assert side[0].leaf == "compact" and side[0].calls == 5
    assert build.delivered_fraction < 1.0
    assert not build.masked


def test_an_answer_two_leaves_produced_masks_the_rollout():
    first = chain_entries(2, prefix="a", system=[5, 6])
    second = chain_entries(2, prefix="b", system=[7, 8], created_at=10)
    second[-1].output_items = [message("a says 1")]  # both leaves said the same thing
    build = run_builder(first + second, final_answer=[message("a says 1")])
    assert build.masked and build.main_chain == ()
    assert build.mask_reasons == ("final answer matches 2 captured calls",)


def test_final_answer_matching_ignores_whitespace_and_json_key_order():
    calls = chain_entries(2)
    tool_call = {
        "type": "function_call",
        "call_id": "x1",
        "name": "bash",
        "arguments": '{"cmd": "ls", "cwd": "/tmp"}',
    }
    other = chain_entries(2, prefix="z", system=[8, 9], created_at=-10)
    calls[-1].output_items = [message("thinking"), tool_call]
    calls[-1].token_item_index = 0
    answer = [{**tool_call, "arguments": '{"cwd":"/tmp","cmd":"ls"}'}]
    assert run_builder(other + calls, final_answer=answer).main_chain[0] == "c000"
    other[-1].output_items = [message("All\n  done.")]
    build = run_builder(other + calls, final_answer="All done.")
    assert build.main_chain == ("z000", "z001") and build.main_chain_by == "final_answer"


def test_projection_is_contiguous_and_carries_the_running_sequence():
    calls = chain_entries(4)
    build = run_builder(calls)
    output = list(build.output)
    assert len(output) == 4
    for item, call in zip(output, calls, strict=True):
        assert item["prompt_token_ids"] == call.prompt_token_ids
        assert item["generation_token_ids"] == call.generation_token_ids
        assert item["generation_log_probs"] == call.generation_log_probs
        assert item["content"][0]["text"] == f"c says {calls.index(call)}"
    assert is_contiguous(output)
    ids, mask = flat_ids_and_mask(output)
    assert ids == full(calls[-1])
    assert sum(mask) == build.generated_tokens_delivered
    for call in calls:
        start = len(call.prompt_token_ids)
        assert mask[start : start + len(call.generation_token_ids)] == [1, 1]
    assert mask[: len(SYSTEM)] == [0] * len(SYSTEM)
    assert build.flat_ids_and_mask() == (ids, mask)


def test_contiguity_check_names_the_break():
    calls = chain_entries(3)
    output = [dict(item) for item in run_builder(calls).output]
    output[2]["prompt_token_ids"] = [*output[2]["prompt_token_ids"]]
    output[2]["prompt_token_ids"][1] += 1
    errors = contiguity_errors(output)
    assert len(errors) == 1 and "carrier 2" in errors[0]
    with pytest.raises(ValueError, match="not contiguous"):
        flat_ids_and_mask(output)
    output[1]["generation_log_probs"] = [-1.0]
    assert any("log-probs" in error for error in contiguity_errors(output))


def test_chat_shaped_items_become_responses_items():
    chat = {
        "role": "assistant",
        "content": "Running it.",
        "reasoning_content": "The user wants ls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
            },
        ],
    }
    only_tool = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "read", "arguments": {"path": "a"}},
            }
        ],
    }
    first = entry("c000", SYSTEM, [1, 2], items=[chat])
    second = entry("c001", SYSTEM + [1, 2, 3], [4], items=[only_tool])
    build = run_builder(
        [first, second],
        final_answer=[
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "read",
                "arguments": '{"path": "a"}',
            }
        ],
    )
    assert build.main_chain_by == "final_answer"
    kinds = [item["type"] for item in build.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    reasoning, text, call, call2 = build.output
    assert reasoning["generation_token_ids"] == [1, 2]  # carrier: first item of the message
    assert text["content"][0] == {"type": "output_text", "text": "Running it.", "annotations": []}
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "bash", '{"cmd": "ls"}')
    assert call2["arguments"] == '{"path":"a"}'
    assert call2["prompt_token_ids"] == [*SYSTEM, 1, 2, 3]
    assert "generation_token_ids" not in text and "generation_token_ids" not in call
    assert is_contiguous(build.output)


def test_responses_carrier_index_and_routed_experts_are_kept():
    items = [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        message("answer"),
    ]
    call = entry("c000", SYSTEM, [1, 2], items=items, routed_experts=[[1, 2], [3, 4]])
    call.token_item_index = 1
    build = run_builder([call])
    assert "generation_token_ids" not in build.output[0]
    assert build.output[1]["generation_token_ids"] == [1, 2]
    assert build.output[1]["routed_experts"] == [[1, 2], [3, 4]]
    assert build.output[1]["content"][0]["text"] == "answer"
    # The entry itself is not changed by projection.
    assert "prompt_token_ids" not in call.output_items[1]


def test_a_call_without_items_still_carries_its_tokens():
    build = run_builder([entry("c000", SYSTEM, [1], items=[])])
    assert len(build.output) == 1
    assert build.output[0]["type"] == "message"
    assert build.output[0]["generation_token_ids"] == [1]


def test_nothing_recorded_masks_and_delivers_nothing():
    build = run_builder(TokenCaptureSnapshot(rollout_id="r1"))
    assert build.masked and "nothing recorded" in build.mask_reasons[0]
    assert build.output == () and build.main_chain == ()
    assert build.delivered_fraction == 0.0
    only_empty = run_builder([entry("e", SYSTEM, [], items=[])])
    assert only_empty.masked and only_empty.main_chain == ()


def test_a_snapshot_and_mappings_are_accepted():
    calls = chain_entries(2)
    snapshot = TokenCaptureSnapshot(
        rollout_id="r1", entries=tuple(calls), snapshot_id="s", version=3
    )
    assert run_builder(snapshot) == run_builder([call.model_dump() for call in calls])


def test_conflicting_or_foreign_entries_are_refused():
    calls = chain_entries(2)
    same = calls[1].model_copy()
    assert run_builder([*calls, same]).n_calls == 2
    changed = calls[1].model_copy(update={"generation_token_ids": [5, 6]})
    with pytest.raises(ConflictingEntryError):
        run_builder([*calls, changed])
    with pytest.raises(ValueError, match="several rollouts"):
        run_builder([*calls, *chain_entries(1, rollout_id="r2")])


def test_sub_agent_sharing_the_system_prompt_is_its_own_root():
    system = list(range(500, 600))  # longer than the first-token key
    main = chain_entries(5, system=system)
    sub = chain_entries(3, prefix="s", system=system + [7], created_at=2.5)
    build = run_builder(main + sub, final_answer=[message("c says 4")])
    assert build.parents["s000"] is None
    assert build.main_chain == tuple(e.model_call_id for e in main)
    assert len(build.roots) == 2


def test_ten_thousand_turns_build_without_recursion():
    turns = 10_000
    master = [i % 251 for i in range(turns + 2)]
    calls = [
        TokenEntry.model_construct(
            rollout_id="long",
            model_call_id=f"c{i:05d}",
            model="",
            routed_experts=None,
            prompt_token_ids=master[: i + 1],
            generation_token_ids=[master[i + 1]],
            generation_log_probs=[-0.5],
            output_items=[message(f"t{i}")],
            token_item_index=0,
            created_at=float(i),
        )
        for i in range(turns)
    ]
    assert sys.getrecursionlimit() < turns
    build = run_builder(calls[::-1], final_answer=[message(f"t{turns - 1}")])
    assert len(build.main_chain) == turns
    assert build.main_chain[0] == "c00000" and build.main_chain[-1] == f"c{turns - 1:05d}"
    assert build.chains[0].calls == turns
    assert not build.masked
    assert len(build.output) == turns
    assert build.output[-1]["prompt_token_ids"] == master[:turns]
    assert build.generated_tokens_delivered == turns


def test_a_chat_shaped_final_answer_matches_a_responses_leaf():
    main = chain_entries(2)
    side = chain_entries(2, prefix="z", system=[8, 9], created_at=-10)
    chat_answer = [
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": [{"type": "text", "text": "c says 1"}]},
    ]
    assert run_builder(side + main, final_answer=chat_answer).main_chain[0] == "c000"
    assert run_builder(side + main, final_answer=message("c  says 1")).main_chain[0] == "c000"
    # An answer no leaf produced delivers nothing: the call that produced it was not captured.
    unmatched = run_builder(side + main, final_answer="something else")
    assert unmatched.masked and unmatched.main_chain == ()
    assert unmatched.mask_reasons == ("final answer matches no captured call",)


# Calls whose reply the harness never received (the client went away, or got a 503). ------


def unreceived_snapshot(entries: list[TokenEntry], unreceived: tuple[str, ...]) -> Any:
    return TokenCaptureSnapshot(rollout_id="r1", entries=tuple(entries), unreceived=unreceived)


def test_an_unreceived_last_call_is_left_out_and_counted():
    calls = chain_entries(4)
    build = run_builder(unreceived_snapshot(calls, ("c003",)), final_answer=[message("c says 2")])
    assert not build.masked, build.mask_reasons
    assert build.main_chain == ("c000", "c001", "c002")
    assert build.unreceived == ("c003",) and summary_of(build).unreceived_calls == 1
    assert build.generated_tokens_delivered == 6
    # Without the note, the same answer matches no leaf: the rollout is masked, never
    # delivered with a call the harness did not see.
    assert run_builder(calls, final_answer=[message("c says 2")]).masked


def test_an_unreceived_call_a_later_call_extends_is_kept():
    calls = chain_entries(4)
    build = run_builder(unreceived_snapshot(calls, ("c001",)), final_answer=[message("c says 3")])
    assert build.main_chain == ("c000", "c001", "c002", "c003")
    assert build.unreceived == () and not build.masked


def test_an_unreceived_call_beside_its_retry_is_no_unresolved_retry():
    calls = chain_entries(3)
    orphan = entry("c002x", calls[2].prompt_token_ids, fresh(2), text="never seen")
    snapshot = unreceived_snapshot([*calls, orphan], ("c002x",))
    build = run_builder(snapshot, final_answer=[message("c says 2")])
    assert not build.masked, build.mask_reasons
    assert build.main_chain == ("c000", "c001", "c002") and build.unreceived == ("c002x",)
    # Unnoted, the two siblings are a retry of the final call: the final answer names the
    # one to keep; an answer neither gave leaves it unresolved, and masked.
    resolved = run_builder([*calls, orphan], final_answer=[message("c says 2")])
    assert not resolved.masked and resolved.discarded_retries == ("c002x",)
    assert run_builder([*calls, orphan], final_answer=[message("neither")]).masked


def test_a_chain_of_unreceived_calls_is_left_out_whole():
    calls = chain_entries(5)
    build = run_builder(
        unreceived_snapshot(calls, ("c003", "c004")), final_answer=[message("c says 2")]
    )
    assert build.main_chain == ("c000", "c001", "c002")
    assert build.unreceived == ("c003", "c004")


def test_a_retry_that_sampled_exactly_the_same_is_one_call_not_an_ambiguity():
    calls = chain_entries(2)
    twin = entry(
        "c001-twin", calls[1].prompt_token_ids, calls[1].generation_token_ids, created_at=5.0
    )
    assert twin.generation_log_probs == calls[1].generation_log_probs
    child = entry("c002", full(calls[1]) + fresh(1), fresh(2), text="done")
    build = run_builder([*calls, twin, child], final_answer=[message("done")])
    assert build.identical_retries == ("c001-twin",)
    assert build.quarantined == () and not build.masked
    assert build.main_chain == ("c000", "c001", "c002")
    assert len(build.chains) == 1
    # Counted once in every metric: the resend's tokens are not captured-but-undelivered.
    assert build.n_calls == 3 and build.delivered_fraction == 1.0
    assert build.generated_tokens_captured == sum(len(c.generation_token_ids) for c in calls) + 2


def test_a_retry_of_the_final_call_is_resolved_by_the_final_answer():
    calls = chain_entries(3)
    retry = entry("c002-retry", calls[2].prompt_token_ids, fresh(2), text="the retry's answer")
    build = run_builder([*calls, retry], final_answer=[message("the retry's answer")])
    assert build.unresolved_retries == ()
    assert build.discarded_retries == ("c002",)
    assert build.main_chain == ("c000", "c001", "c002-retry")
    assert not build.masked and len(build.chains) == 1
    # An answer both siblings gave cannot choose between them: still masked.
    same = entry(
        "c002-same",
        calls[2].prompt_token_ids,
        fresh(2),
        text=calls[2].output_items[0]["content"][0]["text"],
    )
    tied = run_builder([*calls, same], final_answer=calls[2].output_items)
    assert tied.masked
